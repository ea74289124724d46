"""The engine every worker runs (docs/design.md §1): `EngineCore` holding a `KVConnector`.

    core.py       EngineCore: continuous batching over one paged KV pool
    output.py     StepOutput: what a step hands its worker per request
    scheduler.py  waiting queue, running batch, chunked prefill, retract
    request.py    Request and its lifecycle
    runner.py     one ragged forward pass
    stop.py       StopRules: EOS, stop ids, stop strings (incremental), length
    connector.py  KVConnector (the seam with P/D), the ConnectorPorts it gets, NullConnector (colocated)
"""

from __future__ import annotations

from cluster.config import EngineConfig
from prefill_worker.engine.core import EngineCore, debug_kv_enabled
from prefill_worker.engine.output import StepOutput, step_output

__all__ = ["EngineCore", "StepOutput", "debug_kv_enabled", "load_engine", "step_output"]


def load_engine(config: EngineConfig) -> EngineCore:
    """A colocated engine (no connector) for `config.model`: offline runs, benches, tests."""
    from kernels.kv_layout import TORCH_DTYPES
    from kernels.model.loader import load_model

    loaded = load_model(config.model, device=config.device, dtype=TORCH_DTYPES[config.dtype],
                        backend=config.attention_backend)
    return EngineCore(config, loaded.model, loaded.arch, loaded.tokenizer, loaded.eos_token_ids)
