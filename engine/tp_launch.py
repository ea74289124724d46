"""Starting a tensor-parallel engine (`engine/tp.py`): rank 0 in this process, the others spawned,
each loading its shard of the model."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from common.config import EngineConfig
from engine.build import build_engine, choose_attention_backend
from engine.graphs.runner import GraphRunner, graph_max_batch
from engine.graphs.strategy import choose_step_strategy
from engine.graphs.tree import tree_verify_rows
from engine.runner import ModelRunner
from engine.spec.factory import load_draft_head
from engine.tp import ControlGroup, follow, head_calls, join, prepare, rank_device
from engine.tp_tiers import RankTiers
from kv_store.device_pool import DevicePool

if TYPE_CHECKING:  # imported where used (`load_shard`)
    from engine.core import EngineCore
    from kernels.kv_layout import KVCacheTensors
    from kernels.model.loader import LoadedModel
    from kernels.model.tp import Shard, TPGroup
    from kv_store.l3.config import L3Config

log = logging.getLogger("tandem.engine")


def load_shard(config: EngineConfig, rank: int, size: int, device: str,
               serving: bool = False) -> tuple[LoadedModel, list[Shard]]:
    """(This rank's `LoadedModel` (`loaded.model` holds the rank's shard, `loaded.arch` its shapes),
    every rank's `Shard`); `serving`: loaded as a served worker loads (`load_for_serving`: no transformers)."""
    from kernels.kv_layout import TORCH_DTYPES
    from kernels.model.arch import LlamaArch
    from kernels.model.loader import load_for_serving, load_model
    from kernels.model.tp import Shard, TPGroup

    shards: list[Shard] = []

    def shard_of(hf_config: Any) -> TPGroup:  # a transformers config, or config.json read as attributes
        arch = LlamaArch.from_hf_config(hf_config)
        shards[:] = [Shard.of(arch, r, size) for r in range(size)]
        return TPGroup(shards[rank])
    load = load_for_serving if serving else load_model
    loaded = load(config.model, device=device, dtype=TORCH_DTYPES[config.dtype], backend=config.attention_backend,
                  tp=shard_of)
    return loaded, shards


@dataclass
class RankContext:
    """What a worker role's part on a rank other than 0 (`role.start(ctx)`, e.g. a prefill worker's
    `RankSender`) is given: its rank, every rank's `Shard`, its KV cache, the control group, and
    where to register what closes when the rank stops."""

    rank: int
    shards: list[Shard]
    kv: KVCacheTensors
    control: ControlGroup
    closing: contextlib.ExitStack


class RankRole(Protocol):
    """A worker role's part on each rank other than 0 (`prefill_worker/rank_writes.py:RankSender`,
    `decode_worker/rank_landing.py:RankLanding`), pickled to the rank's process."""

    def start(self, ctx: RankContext) -> dict[str, Callable[..., None]]:
        """Set up beside the engine shard; returns the role's calls by name."""
        ...


def follower_main(rank: int, size: int, init_method: str, config: EngineConfig, serving: bool = False,
                  role: RankRole | None = None, parent: int = 0) -> None:
    """A rank other than 0, in a process of its own (dying with its parent): its shard, then the KV
    cache rank 0's resolved config sizes (sent once it is built), its worker role's part (`role`, with
    a `start(RankContext) -> calls by name`), then `follow`."""
    from kernels.kv_layout import TORCH_DTYPES, KVCacheTensors

    _die_with_parent(parent)
    device = rank_device(config, rank)
    torch.set_num_threads(max(1, torch.get_num_threads() // size))
    join(rank, size, init_method, device)
    control = ControlGroup()
    loaded, shards = load_shard(config, rank, size, device, serving)
    kind, resolved, l3 = control.receive()  # l3: (rank 0's L3Config, its model id) or None
    assert kind == "config", f"rank 0 sent {kind!r} before its config"
    arch = loaded.arch
    head = load_draft_head(resolved, loaded.model, arch) if resolved.speculative != "none" else None  # its shard
    all_kv = KVCacheTensors.allocate(arch.num_layers + (head is not None), resolved.num_pages, resolved.page_size,
                                     arch.num_kv_heads, arch.head_dim, TORCH_DTYPES[resolved.dtype], device)
    kv = KVCacheTensors(all_kv.k[:arch.num_layers], all_kv.v[:arch.num_layers])  # the head's layer last, as rank 0's
    backend = choose_attention_backend(resolved, loaded.model, head, torch.device(device))
    eager = ModelRunner(loaded.model, kv, resolved.page_size, device)
    plan = choose_step_strategy(resolved, loaded.model, torch.device(device), backend)  # rank 0's, as it chose
    graphs = GraphRunner(eager, DevicePool(kv), graph_max_batch(resolved), resolved.max_model_len, plan,
                         sizes=resolved.graph_batch_sizes, tree_rows=tree_verify_rows(resolved),
                         tree_batch=max(1, min(resolved.max_running_requests, resolved.speculative_max_batch)))
    with contextlib.ExitStack() as closing:  # (graphs captured (CUDA) with rank 0's, bucket by bucket)
        calls = role.start(RankContext(rank, shards, all_kv, control, closing)) if role is not None else {}
        if head is not None:
            calls.update(head_calls(head, KVCacheTensors(all_kv.k[-1:], all_kv.v[-1:]), kv, device))
        if resolved.host_cache_pages:  # its host tier and L3 part, kept as rank 0's (`engine/tp_tiers.py`)
            calls.update(RankTiers(all_kv, resolved.host_cache_pages, l3, shards[rank], control, closing).calls())
        follow(control, graphs, loaded.model, calls)
    torch.distributed.destroy_process_group()


def _die_with_parent(parent: int, poll_s: float = 0.5) -> None:
    """This process ends when `parent` (rank 0's process) does: a killed worker's ranks must not wait
    for its next call for days. A watch on the parent pid, not `PR_SET_PDEATHSIG`: that fires when
    the spawning *thread* ends (a served worker spawns its ranks from a thread that ends before the
    worker closes). A SIGTERM or SIGINT sent to the whole process group (a terminal's Ctrl-C, a
    supervisor stopping the server) is rank 0's to act on: it stops the ranks ("stop") as it closes,
    which a rank that had ended first would make fail."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)
    threading.Thread(target=watch, name="tandem-tp-parent-watch", daemon=True).start()


class Followers:
    """The processes of ranks 1..size-1 (spawned), and the rendezvous rank 0 joins them through."""

    def __init__(self, config: EngineConfig, serving: bool = False, role: RankRole | None = None) -> None:
        size = config.tensor_parallel_size
        self._dir = tempfile.TemporaryDirectory(prefix="tandem-tp-")
        self.init_method = f"file://{Path(self._dir.name) / 'rendezvous'}"
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=follower_main,
                                  args=(rank, size, self.init_method, config, serving, role, os.getpid()),
                                  name=f"tandem-tp-rank{rank}", daemon=True) for rank in range(1, size)]
        for proc in self.procs:
            proc.start()
        log.info("tensor parallel: %d ranks (rank 0 here, pids %s)", size, [p.pid for p in self.procs])

    def join(self, timeout_s: float = 30.0) -> None:
        for proc in self.procs:
            proc.join(timeout_s)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        self._dir.cleanup()


@dataclass
class Ranks:
    """Rank 0's side of a started group: its config (prepared, its device), the other ranks, the
    control group, its shard (`kernels.model.loader.LoadedModel`), every rank's `Shard`."""

    config: EngineConfig
    followers: Followers
    control: ControlGroup
    loaded: LoadedModel
    shards: list[Shard]

    def stop_with(self, engine: EngineCore) -> None:
        """`engine.close()` (rank 0's engine, built with `control`) also stops the other ranks."""
        engine.on_close(self.stop)

    def stop(self) -> None:
        """Tell the other ranks to stop, wait for them, and leave the process group."""
        self.control.send(("stop",))
        self.followers.join()
        torch.distributed.destroy_process_group()


def start_ranks(config: EngineConfig, serving: bool = False, role: RankRole | None = None) -> Ranks:
    """Spawn ranks 1..N-1 of `config.tensor_parallel_size` (each running `role`'s part, `follower_main`),
    join them as rank 0, load rank 0's shard (`serving`: as a served worker loads, without
    transformers). Build the engine with `control`, then `stop_with` it."""
    config = prepare(config)
    if torch.device(config.device).type == "cpu":  # the ranks share this machine's cores
        torch.set_num_threads(max(1, torch.get_num_threads() // config.tensor_parallel_size))
    followers = Followers(config, serving, role)
    try:
        device = rank_device(config, 0)
        join(0, config.tensor_parallel_size, followers.init_method, device)
        control = ControlGroup()
        loaded, shards = load_shard(config, 0, config.tensor_parallel_size, device, serving)
    except BaseException:
        followers.join(timeout_s=1.0)
        raise
    return Ranks(dataclasses.replace(config, device=device), followers, control, loaded, shards)


def load_tp_engine(config: EngineConfig, populate: bool = True, l3: L3Config | None = None) -> EngineCore:
    """A colocated engine over `config.tensor_parallel_size` ranks (this process rank 0, the others
    spawned; `l3`: an `L3Config` under its host tier); `engine.close()` stops them."""
    ranks = start_ranks(config)
    try:
        loaded = ranks.loaded
        engine = build_engine(ranks.config, loaded.model, loaded.arch, loaded.tokenizer, loaded.eos_token_ids,
                              populate=populate, control=ranks.control, l3=l3)
    except BaseException:
        ranks.followers.join(timeout_s=1.0)
        raise
    ranks.stop_with(engine)
    return engine
