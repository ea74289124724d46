"""A Llama forward whose decoder layers run compiled (inductor), for the CPU decode step.

One compiled function serves all the layers: `run_layers` takes a group of consecutive layers as an
argument, and torch.compile treats a module's parameters as inputs, so the 30 layers of SmolLM2,
called six at a time, share one graph. Compiling one layer a call takes a fraction of the whole
unrolled forward's compile, but each call pays guard checks and wrappers, a visible share of a step
at 30 calls; six layers a call (`GROUP_LAYERS`) keep one sixth of that for a somewhat longer compile
(figures: docs/results.md#cpu-decode, #start-up). Compiled, a one-row matmul is one fused pass over
its weight (`kernels/model/packed_linear.py`), and a layer's norms, rotary, residuals and activation
fuse around it. The KV length stays a dynamic dimension, so nothing compiles again while serving.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from kernels.model.llama import LlamaForCausalLM, run_head, run_layers

INDUCTOR_CACHE = Path.home() / ".cache" / "tandem" / "inductor"
"""Where inductor keeps what it compiled, for the next start (unless TORCHINDUCTOR_CACHE_DIR says otherwise)."""

GROUP_LAYERS = 6
"""Most decoder layers one compiled call runs (the group is the largest divisor of the layer count up
to this, so every call has the same graph)."""


def group_size(num_layers: int, most: int = GROUP_LAYERS) -> int:
    """The largest divisor of `num_layers` that is at most `most`."""
    return max(g for g in range(1, min(most, num_layers) + 1) if num_layers % g == 0)


class CompiledLayers:
    """Callable like the model (`model(input_ids, positions, meta, kv_cache)`), and `forward_with_aux`."""

    def __init__(self, model: LlamaForCausalLM):
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(INDUCTOR_CACHE))
        self.model = model
        self.group_size = group_size(model.arch.num_layers)
        self.layers_fn = torch.compile(run_layers, dynamic=True)
        self.head_fn = run_head  # eager: the lm_head's one row runs faster through oneDNN than compiled

    @staticmethod
    def compiling():
        """The context of the calls that compile (a warm-up): the floats a group reads from its layers
        (norm eps, attention scale) are constants of the graph. The layers are an argument, so dynamo
        would first trace those floats as symbolic inputs, fail to turn them into tensors, and trace
        the whole group again, throwing seconds of tracing and compiling away per thread count
        (docs/results.md#start-up). Scoped to compiling, though entering it is cheap."""
        import torch._dynamo.config

        return torch._dynamo.config.patch(specialize_float=True)

    def __call__(self, input_ids, positions, meta, kv_cache) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, logits, _ = self.forward_with_aux(input_ids, positions, meta, kv_cache, ())
        return hidden, logits

    def forward_with_aux(self, input_ids, positions, meta, kv_cache, aux_layer_ids):
        return self.model.forward_with_aux(input_ids, positions, meta, kv_cache, aux_layer_ids,
                                           self.layers_fn, self.head_fn, self.group_size)
