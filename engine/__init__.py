"""The engine every worker runs (docs/design.md §1): `EngineCore` holding a `KVConnector`.

    build.py      build_engine: makes and wires an engine's parts, in one written order
    core.py       EngineCore: the step loop over one paged KV pool
    endings.py    Endings: every way a request ends (the request table's release paths)
    forward.py    a step's forward pass, retried row by row so a faulty row fails only its request
    output.py     StepOutput: what a step hands its worker per request
    scheduler.py  waiting queue, running batch, chunked prefill, retract; the one owner of request KV
    sessions.py   streaming sessions: a conversation's history pinned between turns
    request.py    Request and its lifecycle (its tier and draft state in parts of their own)
    runner.py     one ragged forward pass (eager)
    tokens.py     sampling or verifying each row's tokens, stop rules token by token
    stop.py       StopRules: EOS, stop ids, stop strings (incremental), length
    tiers.py      the host tier (L2/L3) an engine gets from its config
    stats.py      the heartbeat's figures
    worker_base.py  EngineWorker: the workers' base, what each answers from its engine, message dispatch
    connector.py  KVConnector (the seam with P/D), the ConnectorPorts it gets, NullConnector (colocated)
    graphs/       steps replayed from static buffers (capture, tree verify, GraphRunner, draft head)
    spec/         EAGLE speculation (speculator, draft trees, the drafting policy)
"""

from __future__ import annotations

from common.config import EngineConfig
from engine.build import build_engine
from engine.core import EngineCore, debug_kv_enabled
from engine.output import StepOutput, step_output

__all__ = ["EngineCore", "StepOutput", "build_engine", "debug_kv_enabled", "load_engine", "step_output"]


def load_engine(config: EngineConfig, populate: bool = True) -> EngineCore:
    """A colocated engine (no connector) for `config.model`: offline runs, benches, tests
    (`populate`: as `build_engine` takes it)."""
    from kernels.kv_layout import TORCH_DTYPES
    from kernels.model.loader import load_model

    if config.tensor_parallel_size > 1:
        from engine.tp_launch import load_tp_engine

        return load_tp_engine(config, populate)

    loaded = load_model(config.model, device=config.device, dtype=TORCH_DTYPES[config.dtype],
                        backend=config.attention_backend)
    return build_engine(config, loaded.model, loaded.arch, loaded.tokenizer, loaded.eos_token_ids, populate=populate)
