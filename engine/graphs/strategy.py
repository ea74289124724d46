"""How an engine runs its decode steps, chosen once when it is built (`choose_step_strategy`).

    cuda_graph   CUDA: each batch bucket captured into a CUDA graph at start-up and replayed; speculative
                 verify rows replay as decode rows, full tree verify rows (and the draft head's tree
                 levels) from graphs of their own where the backend is Triton
    c_layers     CPU: buckets of up to `NativeDecode.max_rows` requests (any size where oneDNN cannot
                 multiply the dtype natively) replayed through decoder layers in C (`kernels/cpu/`);
                 needs the "cpu" attention backend (the layers attend with its kernel), a model the
                 layers take, and the C kernels built here
    compiled     CPU: bucket 1 replayed through inductor-compiled decoder layers (`engine.cpu_compile`; a
                 MoE model, whose routing sizes the experts' work from the step's tokens, runs buffers)
    buffers      CPU: every bucket replayed by the eager model over the static buffers (the same
                 padding and gates as a graph replay, nothing captured or compiled)
    eager        every step runs the eager forward (`engine.cuda_graph` off)

The graph runner (`runner.py`), the speculator's head graphs and the tree graphs take the plan; none
of them asks which device it is on.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from common.config import EngineConfig
from kernels.model.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from kernels.cpu.decode_layer import NativeDecode


class StepStrategy(str, enum.Enum):
    CUDA_GRAPH = "cuda_graph"
    C_LAYERS = "c_layers"
    COMPILED = "compiled"
    BUFFERS = "buffers"
    EAGER = "eager"


@dataclass(frozen=True)
class StepPlan:
    strategy: StepStrategy
    why: str = ""
    """What decided it (for the start-up log)."""
    native: NativeDecode | None = None
    """c_layers: the `NativeDecode` that runs the layers."""

    @property
    def replays(self) -> bool:
        """Whether steps may replay over the static buffers (every strategy but eager)."""
        return self.strategy is not StepStrategy.EAGER

    @property
    def captures(self) -> bool:
        """Whether the buckets are captured CUDA graphs (verify rows then replay as decode rows)."""
        return self.strategy is StepStrategy.CUDA_GRAPH

    def describe(self) -> str:
        return f"{self.strategy.value} ({self.why})" if self.why else self.strategy.value


def choose_step_strategy(config: EngineConfig, model: LlamaForCausalLM, device: torch.device, backend: str) -> StepPlan:
    """The plan for an engine of `config` running `model` on `device` with attention `backend` (the
    resolved name), by the table in the module docstring."""
    if not config.cuda_graph:
        return StepPlan(StepStrategy.EAGER, "engine.cuda_graph off")
    if device.type == "cuda":
        return StepPlan(StepStrategy.CUDA_GRAPH, f"{backend} attention")
    if device.type != "cpu":
        return StepPlan(StepStrategy.BUFFERS, f"nothing to capture or compile on {device.type}")
    passed = []
    if not config.cpu_native_decode:
        passed.append("engine.cpu_native_decode off")
    elif backend != "cpu":
        passed.append(f"C layers need the cpu attention backend, not {backend}")
    else:
        from kernels.cpu.decode_layer import NativeDecode

        native = NativeDecode.for_model(model)
        if native is not None:
            rows = "any size" if native.max_rows is None else f"up to {native.max_rows} requests"
            return StepPlan(StepStrategy.C_LAYERS, f"{rows}, {str(native.dtype).removeprefix('torch.')}", native)
        passed.append("the C layers do not take this model" if getattr(model, "arch", None) is None or
                      model.arch.plain_llama else f"the C layers are Llama's, not {model.arch.model_type}'s")
    if config.cpu_compile and getattr(getattr(model, "arch", None), "is_moe", False):
        passed.append("a MoE model's routing sizes each expert's work from the step's tokens: eager")
    elif config.cpu_compile:
        return StepPlan(StepStrategy.COMPILED, "; ".join(passed))
    return StepPlan(StepStrategy.BUFFERS, "; ".join([*passed, "engine.cpu_compile off"]))
