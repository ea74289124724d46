"""A CPU decode step of a few sequences with its decoder layers in C (`tandem_decode_layer_f32`).

One token of one sequence is ~120 matrix-vector products over the weights (SmolLM2: 425 MB of
float32 a token) and ~20 small ops a layer around them. Inductor's compiled layers
(`kernels/model/compiled.py`) fuse the small ops but stream the weights at ~15-17 GB/s on 2 cores
(one fused product-sum a matmul), and take ~10 s to compile at every start; a C layer reads each
weight row once, four rows a pass, at ~22-24 GB/s (SmolLM2's 120 layer matmuls: 17.6 vs 25-28 ms,
2 cores, same run), runs the norms, rotary, K/V write, attention (`attend`, the batched decode
kernel's) and activation between them on the same OpenMP team, and needs no compile.

The weights stay where the model keeps them (HF's row-major layout, no copy); their addresses are
taken when this is made, so it serves a model whose weights do not change afterwards (a served
engine's). The embedding and the head (the final norm and the lm_head's oneDNN matmul) stay torch's.
"""

from __future__ import annotations

import ctypes

import torch

from kernels.attention import cpu_native
from kernels.model.llama import LlamaForCausalLM, run_head

MAX_ROWS = 4
"""Most sequences a step the C layer runs: each weight row is read from memory once for all of them,
and re-read from L1 for every row after the first, which stays cheap up to a few rows; bigger batches
take oneDNN's packed matmuls (`PackedLinear`), which serve 8-16 rows better."""


class NativeDecode:
    """Callable like the model (`model(input_ids, positions, meta, kv_cache)`) and `forward_with_aux`,
    for a step of one decode token of each of up to `MAX_ROWS` sequences (`supports_step`; any other
    step runs the model's own forward); `for_model` makes one."""

    def __init__(self, model: LlamaForCausalLM, lib: ctypes.CDLL):
        arch = model.arch
        self.model, self._lib = model, lib
        self._dims = (arch.num_heads, arch.num_kv_heads, arch.head_dim)
        self._layer_args = {id(layer): self._args_of(layer) for layer in model.model.layers}
        scratch = lib.tandem_decode_layer_scratch(MAX_ROWS, arch.hidden_size, *self._dims, arch.intermediate_size)
        self._scratch = torch.empty(scratch, dtype=torch.float32)
        self._scale = float(model.model.layers[0].self_attn.scale)

    @classmethod
    def for_model(cls, model: LlamaForCausalLM) -> NativeDecode | None:
        """One for `model` where the C layer serves it (a float32 CPU Llama-family model without MLP
        biases, heads the attention kernel takes, the kernel built on this machine), else None."""
        if not isinstance(model, LlamaForCausalLM):  # a wrapper (a test's) keeps its own forward
            return None
        arch, lib = model.arch, cpu_native.kernel()
        weight = model.model.layers[0].mlp.gate_up_proj.weight
        if lib is None or weight.device.type != "cpu" or weight.dtype != torch.float32 or arch.mlp_bias:
            return None
        if arch.head_dim % 2 or not cpu_native.takes_heads(lib, arch.num_heads, arch.num_kv_heads, arch.head_dim):
            return None
        return cls(model, lib)

    @staticmethod
    def _args_of(layer) -> tuple:
        attn, mlp = layer.self_attn, layer.mlp
        tensors = (layer.input_layernorm.weight, attn.qkv_proj.weight, attn.o_proj.weight,
                   layer.post_attention_layernorm.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight)
        assert all(t.is_contiguous() and t.dtype == torch.float32 for t in tensors), "a layer weight not float32 rows"
        bias = [b.data_ptr() if b is not None else None for b in (attn.qkv_proj.bias, attn.o_proj.bias)]
        return (layer.input_layernorm.eps, *(t.data_ptr() for t in tensors), *bias)

    @staticmethod
    def supports_step(input_ids: torch.Tensor, meta) -> bool:
        """One new token of each of at most `MAX_ROWS` sequences, no tree: what the C layer computes."""
        return input_ids.shape[0] == meta.num_seqs <= MAX_ROWS and meta.decode_only

    def __call__(self, input_ids, positions, meta, kv_cache) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, logits, _ = self.forward_with_aux(input_ids, positions, meta, kv_cache, ())
        return hidden, logits

    def forward_with_aux(self, input_ids, positions, meta, kv_cache, aux_layer_ids):
        if not self.supports_step(input_ids, meta):
            return self.model.forward_with_aux(input_ids, positions, meta, kv_cache, aux_layer_ids)
        return self.model.forward_with_aux(input_ids, positions, meta, kv_cache, aux_layer_ids, self._layers,
                                           run_head, self.model.arch.num_layers)

    def _layers(self, layers, x, cos, sin, meta, k_caches, v_caches, keep_entering):
        """`run_layers` for the whole stack, in C, on x in place (x: the embedding's fresh output)."""
        assert x.is_contiguous() and cos.is_contiguous() and sin.is_contiguous() and meta.page_table.stride(1) == 1
        assert meta.seq_lens.is_contiguous() and meta.slot_mapping.is_contiguous()
        arch, lib, entering = self.model.arch, self._lib, []
        heads, kv_heads, head_dim = self._dims
        for layer, k_cache, v_cache in zip(layers, k_caches, v_caches):
            assert k_cache.dtype == v_cache.dtype == torch.float32, "the KV cache is not float32 like the model"
            assert k_cache.is_contiguous() and v_cache.is_contiguous(), "KV pages not [P, page_size, kvh, hd] rows"
            if keep_entering:
                entering.append(x.clone())
            eps, in_norm, qkv, o, post_norm, gate_up, down, qkv_bias, o_bias = self._layer_args[id(layer)]
            lib.tandem_decode_layer_f32(
                x.shape[0], x.data_ptr(), arch.hidden_size, eps, in_norm, qkv, qkv_bias, o, o_bias, post_norm,
                gate_up, down, arch.intermediate_size, cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(),
                v_cache.data_ptr(), meta.page_table.data_ptr(), meta.page_table.stride(0), meta.seq_lens.data_ptr(),
                meta.slot_mapping.data_ptr(), heads, kv_heads, head_dim, k_cache.shape[1], self._scale,
                self._scratch.data_ptr())
        return x, tuple(entering)
