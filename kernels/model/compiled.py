"""A Llama forward whose decoder layers run compiled (inductor), for the CPU decode step.

One compiled function serves all the layers: `run_layer` takes the layer as an argument, and
torch.compile treats a module's parameters as inputs, so the 30 layers of SmolLM2 share one graph:
one layer's compile (~6 s on 2 cores, ~3 s from inductor's on-disk cache) instead of the whole
unrolled forward's (~45 s, ~20 s cached), for a step within ~10% of the whole forward compiled
(each call pays ~50 us of guard checks). Compiled, a one-row matmul is one fused pass over its
weight (`kernels/model/packed_linear.py`), and a layer's norms, rotary, residuals and activation
fuse around it. The KV length stays a dynamic dimension, so nothing compiles again while serving.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from kernels.model.llama import LlamaForCausalLM, run_head, run_layer

INDUCTOR_CACHE = Path.home() / ".cache" / "tandem" / "inductor"
"""Where inductor keeps what it compiled, for the next start (unless TORCHINDUCTOR_CACHE_DIR says otherwise)."""


class CompiledLayers:
    """Callable like the model (`model(input_ids, positions, meta, kv_cache)`), and `forward_with_aux`."""

    def __init__(self, model: LlamaForCausalLM):
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(INDUCTOR_CACHE))
        self.model = model
        self.layer_fn = torch.compile(run_layer, dynamic=True)
        self.head_fn = run_head  # eager: the lm_head's one row runs faster through oneDNN (4.3 vs 4.8 ms)

    def __call__(self, input_ids, positions, meta, kv_cache) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, logits, _ = self.forward_with_aux(input_ids, positions, meta, kv_cache, ())
        return hidden, logits

    def forward_with_aux(self, input_ids, positions, meta, kv_cache, aux_layer_ids):
        return self.model.forward_with_aux(input_ids, positions, meta, kv_cache, aux_layer_ids,
                                           self.layer_fn, self.head_fn)
