"""What a worker is built from (`WorkerSpec`, picklable) and how: the model, the role's worker, its
transport. Shared by the worker process (`process.py`) and the worker thread (`thread.py`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from cluster.config import EngineConfig
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


def build_worker(spec: WorkerSpec, transport=None):
    """Load the model and make the role's worker and its transport (a process's or a thread's).
    `transport`: the one to use (tests: an in-process `LocalTransport`); None: Mooncake on
    `spec.transport`'s address (a colocated worker, which no peer writes to, gets a local one)."""
    import torch

    from kernels.model.loader import load_model
    from kv_store.transfer.mooncake import MooncakeTransport
    from prefill_worker.engine_core import TORCH_DTYPES

    torch.set_num_threads(spec.torch_threads)
    loaded = load_model(spec.engine.model, device=spec.engine.device, dtype=TORCH_DTYPES[spec.engine.dtype])
    if spec.role == "colocated":  # no peer ever writes to it: an in-process endpoint, a token host tier
        from kv_store.transfer.local import LocalTransport

        transport, spec = transport or LocalTransport(), dataclasses.replace(spec, host_pages=2)
    elif transport is None:
        transport = MooncakeTransport(spec.transport.hostname, spec.transport.protocol)
    args = (spec.engine, loaded.model, loaded.arch, transport)
    kwargs = dict(tokenizer=loaded.tokenizer, eos_token_ids=loaded.eos_token_ids, deadlines=spec.transport)
    if spec.role == "prefill":
        from prefill_worker.worker import PrefillWorker

        worker = PrefillWorker(*args, **kwargs)
    else:
        from decode_worker.worker import DecodeWorker

        worker = DecodeWorker(*args, host_pages=spec.host_pages, **kwargs)
    worker.role_name = spec.role
    return worker, transport


def worker_spec(role: str, engine: EngineConfig, **kw) -> WorkerSpec:
    return dataclasses.replace(WorkerSpec(role, engine), **kw)
