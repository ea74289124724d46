"""What a worker is built from (`WorkerSpec`, picklable) and how: the model, the role's worker, its
transport. Shared by the worker process (`process.py`) and the worker thread (`thread.py`).

`make_worker` is the one place a role is assembled: the engine (`build_engine`) with the role's
connector, then the worker around them."""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from cluster.worker_host.cores import CoreShareSpec
from common.config import EngineConfig
from common.protocol import WorkerRole
from kv_store.l3.config import L3Config
from kv_store.transfer.config import TransportConfig
from kv_store.transfer.session import TransferDeadlines

log = logging.getLogger("tandem.worker")


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process needs to build itself (picklable)."""

    role: WorkerRole  # its value ("prefill" | "decode" | "colocated") is taken too, and made a WorkerRole
    engine: EngineConfig
    host_pages: int = 0  # decode only: landing pool pages
    transport: TransportConfig = TransportConfig()  # the transfer engine's protocol and address, the deadlines
    heartbeat_interval_s: float = 0.5
    torch_threads: int = 1
    l3: L3Config | None = None  # the shared L3 store under the host cache; None: none
    core_share: CoreShareSpec | None = None  # lend/borrow torch threads with the node's other workers (cores.py)
    inject_faults: str = ""  # chaos runs only (`common/chaos.py`): "site=chance,..."

    def __post_init__(self):
        object.__setattr__(self, "role", worker_role(self.role))


def build_worker(spec: WorkerSpec, transport=None):
    """Load the model and make the role's worker and its transport (a process's or a thread's).
    `transport`: the one to use (tests: an in-process `LocalTransport`); None: Mooncake on
    `spec.transport`'s address (a colocated worker, which no peer writes to, gets a local one: its
    session id names it)."""
    start_s = time.perf_counter()
    import torch

    from cluster.train.shipped import with_default_draft
    from kernels.kv_layout import TORCH_DTYPES
    from kernels.model.loader import load_for_serving

    torch.set_num_threads(spec.torch_threads)
    if spec.inject_faults:
        from common import chaos

        chaos.configure(spec.inject_faults)
        log.warning("injecting faults on purpose (a chaos run): %s", spec.inject_faults)
    engine = with_default_draft(spec.engine)  # this node's cached head
    if spec.role is WorkerRole.PREFILL:  # it never decodes: compiling its decode step would only delay its start
        engine = dataclasses.replace(engine, cpu_compile=False)
    spec = dataclasses.replace(spec, engine=engine)
    if engine.tensor_parallel_size > 1:
        return _build_tensor_parallel(spec, transport, start_s)
    loaded = load_for_serving(spec.engine.model, device=spec.engine.device, dtype=TORCH_DTYPES[spec.engine.dtype],
                              backend=spec.engine.attention_backend)
    log.info("model loaded %.1f s after the worker began building (imports included)", time.perf_counter() - start_s)
    # a served worker is ready before its CPU decode step is compiled: the loop starts the compile
    # (`Worker.start`), and the step replays eagerly until it is in place
    model = dict(tokenizer=loaded.tokenizer, eos_token_ids=loaded.eos_token_ids, l3=spec.l3, compile_in_background=True)
    if spec.role is WorkerRole.COLOCATED:
        from kv_store.transfer.local import LocalTransport

        worker = make_worker(WorkerRole.COLOCATED, spec.engine, loaded.model, loaded.arch, **model)
        log.info("worker built in %.1f s", time.perf_counter() - start_s)
        return worker, transport or LocalTransport()
    if transport is None:
        from kv_store.transfer.mooncake import MooncakeTransport

        transport = MooncakeTransport(spec.transport.hostname, spec.transport.protocol)
    engine = spec.engine
    if spec.role is WorkerRole.PREFILL:  # packing would cost it a second copy for little (unless asked for by name)
        engine = dataclasses.replace(engine, cpu_prepack=bool(engine.cpu_prepack))
    worker = make_worker(spec.role, engine, loaded.model, loaded.arch, transport, host_pages=spec.host_pages,
                         deadlines=spec.transport, **model)
    log.info("worker built in %.1f s (model, transport, engine)", time.perf_counter() - start_s)
    return worker, transport


def _build_tensor_parallel(spec: WorkerSpec, transport, start_s: float):
    """A worker whose engine spans `spec.engine.tensor_parallel_size` ranks: this process rank 0, the
    others spawned beside it (`engine/tp_launch.py`), stopped with the engine. A prefill or decode
    worker's ranks each get a transport of their own: KV moves rank pair by rank pair
    (`prefill_worker/rank_writes.py`, `decode_worker/rank_landing.py`)."""
    from decode_worker.rank_landing import OtherLandings, RankLanding
    from engine.tp_launch import start_ranks
    from kv_store.transfer.local import LocalTransport
    from prefill_worker.rank_writes import OtherRanks, RankSender

    role, others = spec.role, None
    if role is not WorkerRole.COLOCATED:
        if transport is None:
            from kv_store.transfer.mooncake import MooncakeTransport

            transport = MooncakeTransport(spec.transport.hostname, spec.transport.protocol)
        hostname = transport.session_id.rsplit(":", 1)[0]  # the other ranks bind where rank 0 did
        others = (RankSender(hostname, spec.transport.protocol) if role is WorkerRole.PREFILL
                  else RankLanding(hostname, spec.transport.protocol, spec.host_pages))
    ranks = start_ranks(spec.engine, serving=True, role=others)
    loaded, held = ranks.loaded, [shard.kv_heads for shard in ranks.shards]
    peers: OtherRanks | Callable[[], OtherLandings] | None = None  # the connector's side of the other ranks'
    if role is WorkerRole.PREFILL:
        peers = OtherRanks(ranks.control, held)
    elif role is WorkerRole.DECODE:
        peers = functools.partial(OtherLandings, ranks.control, held)  # made by the receiver once its own landing is
    try:
        worker = make_worker(role, ranks.config, loaded.model, loaded.arch, transport, host_pages=spec.host_pages,
                             deadlines=spec.transport, tokenizer=loaded.tokenizer, eos_token_ids=loaded.eos_token_ids,
                             l3=spec.l3, control=ranks.control, others=peers)
    except BaseException:
        ranks.followers.join(timeout_s=1.0)
        raise
    ranks.stop_with(worker.engine)
    log.info("worker built in %.1f s over %d ranks", time.perf_counter() - start_s, spec.engine.tensor_parallel_size)
    return worker, transport or LocalTransport()


def worker_role(role: WorkerRole | str) -> WorkerRole:
    """`role`, or the role its value names; a clear error for any other."""
    try:
        return WorkerRole(role)
    except ValueError:
        raise ValueError(f"unknown worker role {role!r}: one of {sorted(r.value for r in WorkerRole)}") from None


def make_worker(role: WorkerRole | str, config: EngineConfig, model, arch, transport=None, *, host_pages: int = 0,
                tokenizer=None, eos_token_ids=(), deadlines: TransferDeadlines = TransferDeadlines(),
                clock: Callable[[], float] = time.monotonic, l3: L3Config | None = None, draft_head=None,
                compile_in_background: bool = False, control=None, others=None):
    """The `role` worker (a `WorkerRole` or its value) over `model`: its engine built with the
    role's connector (a prefill worker's `KVSender`, a decode worker's `KVReceiver` with `host_pages`
    landing pages, both over `transport`), then the worker around the engine (`control`: rank 0's
    control group of a tensor-parallel engine; `others`: its connector's side of the other ranks')."""
    from common.config import STAGING_CHUNKS
    from decode_worker.receiver import KVReceiver
    from decode_worker.worker import ColocatedWorker, DecodeWorker
    from engine import build_engine
    from prefill_worker.sender import KVSender
    from prefill_worker.worker import PrefillWorker

    role = worker_role(role)
    if role is WorkerRole.PREFILL and config.cuda_graph:  # it never decodes: capturing buckets would only cost
        config = dataclasses.replace(config, cuda_graph=False)  # start-up time and device memory
    staging_pages = STAGING_CHUNKS * -(-config.chunk_size // config.page_size)
    connectors = {WorkerRole.PREFILL: lambda ports: KVSender(ports, transport, deadlines, clock, staging_pages, others),
                  WorkerRole.DECODE: lambda ports: KVReceiver(ports, transport, host_pages, deadlines, clock, others),
                  WorkerRole.COLOCATED: None}
    workers = {WorkerRole.PREFILL: PrefillWorker, WorkerRole.DECODE: DecodeWorker,
               WorkerRole.COLOCATED: ColocatedWorker}
    engine = build_engine(config, model, arch, tokenizer, eos_token_ids, connector=connectors[role], l3=l3,
                          draft_head=draft_head, compile_in_background=compile_in_background, control=control)
    return workers[role](engine)
