"""The colocated engine: a decode worker that prefills locally (DESIGN §1, §2).

It is the engine core as is; `tandem run` and the unit tests use it, and the disaggregated decode
worker falls back to it when no prefill worker is alive.
"""

from __future__ import annotations

from cluster.config import EngineConfig
from prefill_worker.engine_core import TORCH_DTYPES, EngineCore, StepOutput, debug_kv_enabled

__all__ = ["ColocatedEngine", "StepOutput", "debug_kv_enabled"]


class ColocatedEngine(EngineCore):
    @classmethod
    def from_config(cls, config: EngineConfig) -> "ColocatedEngine":
        from kernels.model.loader import load_model

        loaded = load_model(config.model, device=config.device, dtype=TORCH_DTYPES[config.dtype],
                            backend=config.attention_backend)
        return cls(config, loaded.model, loaded.arch, loaded.tokenizer, loaded.eos_token_ids)
