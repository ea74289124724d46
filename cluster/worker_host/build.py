"""What a worker is built from (`WorkerSpec`, picklable) and how: the model, the role's worker, its
transport. Shared by the worker process (`process.py`) and the worker thread (`thread.py`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from cluster.config import EngineConfig
from cluster.worker_host.cores import CoreShareSpec
from kv_store.l3.config import L3Config
from kv_store.transfer.config import TransportConfig


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process needs to build itself (picklable)."""

    role: str  # "prefill" | "decode" | "colocated" (a decode worker that only prefills locally)
    engine: EngineConfig
    host_pages: int = 0  # decode only: host-tier pages for landings
    transport: TransportConfig = TransportConfig()  # the transfer engine's protocol and address, the deadlines
    heartbeat_interval_s: float = 0.5
    torch_threads: int = 1
    l3: L3Config | None = None  # the shared L3 store under the host cache; None: none
    core_share: CoreShareSpec | None = None  # lend/borrow torch threads with the node's other workers (cores.py)


def build_worker(spec: WorkerSpec, transport=None):
    """Load the model and make the role's worker and its transport (a process's or a thread's).
    `transport`: the one to use (tests: an in-process `LocalTransport`); None: Mooncake on
    `spec.transport`'s address (a colocated worker, which no peer writes to, gets a local one: its
    session id names it)."""
    import torch

    from cluster.cli.args import with_default_draft
    from kernels.kv_layout import TORCH_DTYPES
    from kernels.model.loader import load_for_serving

    torch.set_num_threads(spec.torch_threads)
    engine = with_default_draft(spec.engine)  # this node's cached head
    if spec.role == "prefill":  # it never decodes: compiling its decode step would only delay its start
        engine = dataclasses.replace(engine, cpu_compile=False)
    spec = dataclasses.replace(spec, engine=engine)
    loaded = load_for_serving(spec.engine.model, device=spec.engine.device, dtype=TORCH_DTYPES[spec.engine.dtype],
                              backend=spec.engine.attention_backend)
    model = dict(tokenizer=loaded.tokenizer, eos_token_ids=loaded.eos_token_ids, l3=spec.l3)
    if spec.role == "colocated":
        from decode_worker.worker import ColocatedWorker
        from kv_store.transfer.local import LocalTransport
        from prefill_worker.engine import build_engine

        return ColocatedWorker(build_engine(spec.engine, loaded.model, loaded.arch, **model)), transport or LocalTransport()
    if transport is None:
        from kv_store.transfer.mooncake import MooncakeTransport

        transport = MooncakeTransport(spec.transport.hostname, spec.transport.protocol)
    args = (spec.engine, loaded.model, loaded.arch, transport)
    if spec.role == "prefill":
        from prefill_worker.worker import PrefillWorker

        # Packed weights would cost a prefill worker a second copy for ~10% (unless asked for by name).
        args = (dataclasses.replace(spec.engine, cpu_prepack=bool(spec.engine.cpu_prepack)), *args[1:])
        return PrefillWorker(*args, deadlines=spec.transport, **model), transport
    from decode_worker.worker import DecodeWorker

    return DecodeWorker(*args, host_pages=spec.host_pages, deadlines=spec.transport, **model), transport
