"""Starting a tensor-parallel engine (`engine/tp.py`): rank 0 in this process, the others spawned,
each loading its shard of the model."""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import tempfile
from pathlib import Path

import torch

from common.config import EngineConfig
from engine.build import build_engine, choose_attention_backend
from engine.graphs.runner import GraphRunner, graph_max_batch
from engine.graphs.strategy import choose_step_strategy
from engine.runner import ModelRunner
from engine.tp import ControlGroup, follow, join, prepare, rank_device
from kv_store.device_pool import DevicePool

log = logging.getLogger("tandem.engine")


def load_shard(config: EngineConfig, rank: int, size: int, device: str):
    """This rank's `LoadedModel` (`loaded.model` holds the rank's shard, `loaded.arch` its shapes)."""
    from kernels.kv_layout import TORCH_DTYPES
    from kernels.model.arch import LlamaArch
    from kernels.model.loader import load_model
    from kernels.model.tp import Shard, TPGroup

    def shard_of(hf_config):
        return TPGroup(Shard.of(LlamaArch.from_hf_config(hf_config), rank, size))
    return load_model(config.model, device=device, dtype=TORCH_DTYPES[config.dtype],
                      backend=config.attention_backend, tp=shard_of)


def follower_main(rank: int, size: int, init_method: str, config: EngineConfig) -> None:
    """A rank other than 0, in a process of its own: its shard, then the KV cache rank 0's resolved config
    sizes (sent once it is built), then `follow`."""
    from kernels.kv_layout import TORCH_DTYPES, KVCacheTensors

    device = rank_device(config, rank)
    torch.set_num_threads(max(1, torch.get_num_threads() // size))
    join(rank, size, init_method, device)
    control = ControlGroup()
    loaded = load_shard(config, rank, size, device)
    kind, resolved = control.receive()
    assert kind == "config", f"rank 0 sent {kind!r} before its config"
    arch = loaded.arch
    kv = KVCacheTensors.allocate(arch.num_layers, resolved.num_pages, resolved.page_size, arch.num_kv_heads,
                                 arch.head_dim, TORCH_DTYPES[resolved.dtype], device)
    backend = choose_attention_backend(resolved, loaded.model, None, torch.device(device))
    eager = ModelRunner(loaded.model, kv, resolved.page_size, device)
    plan = choose_step_strategy(resolved, loaded.model, torch.device(device), backend)  # rank 0's, as it chose
    graphs = GraphRunner(eager, DevicePool(kv), graph_max_batch(resolved), resolved.max_model_len, plan,
                         sizes=resolved.graph_batch_sizes)  # captured (CUDA) with rank 0's, bucket by bucket
    follow(control, graphs, loaded.model)
    torch.distributed.destroy_process_group()


class Followers:
    """The processes of ranks 1..size-1 (spawned), and the rendezvous rank 0 joins them through."""

    def __init__(self, config: EngineConfig) -> None:
        size = config.tensor_parallel_size
        self._dir = tempfile.TemporaryDirectory(prefix="tandem-tp-")
        self.init_method = f"file://{Path(self._dir.name) / 'rendezvous'}"
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=follower_main, args=(rank, size, self.init_method, config),
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


def load_tp_engine(config: EngineConfig, populate: bool = True):
    """A colocated engine over `config.tensor_parallel_size` ranks (this process rank 0, the others
    spawned); `engine.close()` stops them."""
    config = prepare(config)
    if torch.device(config.device).type == "cpu":  # the ranks share this machine's cores
        torch.set_num_threads(max(1, torch.get_num_threads() // config.tensor_parallel_size))
    followers = Followers(config)
    try:
        device = rank_device(config, 0)
        join(0, config.tensor_parallel_size, followers.init_method, device)
        control = ControlGroup()
        loaded = load_shard(config, 0, config.tensor_parallel_size, device)
        engine = build_engine(dataclasses.replace(config, device=device), loaded.model, loaded.arch,
                              loaded.tokenizer, loaded.eos_token_ids, populate=populate, control=control)
    except BaseException:
        followers.join(timeout_s=1.0)
        raise
    closing = engine.close

    def close() -> None:
        try:
            closing()
        finally:
            control.send(("stop",))
            followers.join()
            torch.distributed.destroy_process_group()
    engine.close = close
    return engine

