"""A CPU decode step with its decoder layers in C (`tandem_decode_layer`).

One token of one sequence is ~120 matrix-vector products over the weights (SmolLM2: 425 MB of
float32 a token) and ~20 small ops a layer around them. Inductor's compiled layers
(`kernels/cpu/compiled.py`) fuse the small ops but stream the weights further from the memory's
speed (one fused product-sum a matmul), and take seconds to compile at every start; a C layer reads
each weight row once, four rows a pass against two tokens at a time, closer to the memory's speed
(docs/results.md#cpu-decode), runs the norms, rotary, K/V write, attention
(`attend`, the batched decode kernel's) and activation between them on the same OpenMP team, and
needs no compile.

float32 models, and bfloat16 ones: bf16 matrices and KV widened to float32 in registers (half the
bytes a token streams), every value rounded to bf16 where HF's bf16 model rounds it, so the C layer
tracks the torch model to a bf16 step or two (layer 0's K/V bit for bit) and greedy text parts from
it only at near-ties (the head's bf16 matmul, too, runs in C on such CPUs: `PackedLinear`).

How many sequences a step it serves (`max_rows`): up to `MAX_ROWS` where oneDNN multiplies the
model's dtype natively (`cpu_packing_available`: float32 here; bf16 on CPUs with bf16 dot products),
whose packed matmuls serve 8-16 rows better; every decode step where it does not (bf16 on an AVX2
CPU, where torch's bf16 matmul is several times slower than the C layer: docs/results.md#cpu-decode).

The matrices stay where the model keeps them (HF's row-major layout, no copy; norms and biases of a
bf16 model are widened once, a few KB a layer); their addresses are taken when this is made, so it
serves a model whose weights do not change afterwards (a served engine's). The embedding and the head
(the final norm and the lm_head's matmul) stay the model's own.
"""

from __future__ import annotations

import ctypes

import torch

from kernels.cpu import native as cpu_native
from kernels.model.layers import LlamaMLP
from kernels.model.llama import LlamaDecoderLayer, LlamaForCausalLM, run_head
from kernels.model.packed_linear import cpu_packing_available

MAX_ROWS = 4
"""Most sequences a step the C layer runs where oneDNN serves bigger batches: each weight row is read
from memory once for all of them and re-read from L1 for every pair of rows after the first, which
stays cheap up to a few rows; 8-16 rows take oneDNN's packed matmuls (`PackedLinear`)."""

DTYPES = (torch.float32, torch.bfloat16)


class NativeDecode:
    """Callable like the model (`model(input_ids, positions, meta, kv_cache)`) and `forward_with_aux`,
    for a step of one decode token of each of up to `MAX_ROWS` sequences (`supports_step`; any other
    step runs the model's own forward); `for_model` makes one."""

    def __init__(self, model: LlamaForCausalLM, lib: ctypes.CDLL):
        arch = model.arch
        self.model, self._lib = model, lib
        layers = model.model.decoder_layers()
        self.dtype = _dense_mlp(layers[0]).gate_up_proj.weight.dtype
        self.max_rows = MAX_ROWS if cpu_packing_available(self.dtype) else None
        """Most sequences a step this serves; None: every decode step (module docstring)."""
        self._dims = (arch.num_heads, arch.num_kv_heads, arch.head_dim)
        self._kept: list[torch.Tensor] = []  # float32 copies of a bf16 model's norms and biases
        self._layer_args = {id(layer): self._args_of(layer) for layer in layers}
        self._scratch = torch.empty(0, dtype=torch.float32)
        self._scale = float(layers[0].self_attn.scale)

    @classmethod
    def for_model(cls, model: LlamaForCausalLM) -> NativeDecode | None:
        """One for `model` where the C layer serves it (a float32 or bfloat16 CPU Llama-family model
        without MLP biases, heads the attention kernel takes, the kernel built on this machine), else None."""
        if not isinstance(model, LlamaForCausalLM):  # a wrapper (a test's) keeps its own forward
            return None
        arch, lib = model.arch, cpu_native.kernel()
        if not arch.plain_llama:  # the C layer is Llama's alone (q/k norms, windows, experts: the torch layers)
            return None
        weight = _dense_mlp(model.model.decoder_layers()[0]).gate_up_proj.weight
        if lib is None or weight.device.type != "cpu" or weight.dtype not in DTYPES or arch.mlp_bias:
            return None
        if arch.head_dim % 2 or not cpu_native.takes_heads(lib, arch.num_heads, arch.num_kv_heads, arch.head_dim):
            return None
        return cls(model, lib)

    def _args_of(self, layer) -> tuple:
        attn, mlp = layer.self_attn, layer.mlp
        matrices = (attn.qkv_proj.weight, attn.o_proj.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight)
        assert all(t.is_contiguous() and t.dtype == self.dtype for t in matrices), "a layer weight not in rows"
        vectors = [self._float(t) for t in (layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                                            attn.qkv_proj.bias, attn.o_proj.bias)]
        in_norm, post_norm, qkv_bias, o_bias = (v.data_ptr() if v is not None else None for v in vectors)
        qkv, o, gate_up, down = (t.data_ptr() for t in matrices)
        return layer.input_layernorm.eps, in_norm, qkv, qkv_bias, o, o_bias, post_norm, gate_up, down

    def _float(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """`t` as contiguous float32 (itself when it is), kept alive while this lives."""
        if t is None:
            return None
        f = t.detach().float().contiguous()
        if f.data_ptr() != t.data_ptr():
            self._kept.append(f)
        return f

    def supports_step(self, input_ids: torch.Tensor, meta) -> bool:
        """One new token of each of at most `max_rows` sequences, no tree: what the C layer computes."""
        rows = input_ids.shape[0]
        return rows == meta.num_seqs and (self.max_rows is None or rows <= self.max_rows) and meta.decode_only

    def __call__(self, input_ids, positions, meta, kv_cache) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, logits, _ = self.forward_with_aux(input_ids, positions, meta, kv_cache, ())
        return hidden, logits

    def forward_with_aux(self, input_ids, positions, meta, kv_cache, aux_layer_ids):
        if not self.supports_step(input_ids, meta):
            return self.model.forward_with_aux(input_ids, positions, meta, kv_cache, aux_layer_ids)
        return self.model.forward_with_aux(input_ids, positions, meta, kv_cache, aux_layer_ids, self._layers,
                                           run_head, self.model.arch.num_layers)

    def _layers(self, layers, x, cos, sin, meta, k_caches, v_caches, keep_entering):
        """`run_layers` for the whole stack, in C, on float32 rows (x itself for a float32 model: the
        embedding's fresh output; a bf16 model's widened, exactly, and narrowed back, exactly)."""
        assert meta.page_table.stride(1) == 1 and meta.seq_lens.is_contiguous() and meta.slot_mapping.is_contiguous()
        arch, lib, entering = self.model.arch, self._lib, []
        heads, kv_heads, head_dim = self._dims
        x32, cos, sin = (t.float().contiguous() for t in (x, cos, sin))
        rows = x32.shape[0]
        scratch = self._scratch_for(rows)
        for layer, k_cache, v_cache in zip(layers, k_caches, v_caches):
            assert k_cache.dtype == v_cache.dtype == self.dtype, "the KV cache is not of the model's dtype"
            assert k_cache.is_contiguous() and v_cache.is_contiguous(), "KV pages not [P, page_size, kvh, hd] rows"
            if keep_entering:
                entering.append(x32.to(self.dtype, copy=True))
            eps, in_norm, qkv, qkv_bias, o, o_bias, post_norm, gate_up, down = self._layer_args[id(layer)]
            lib.tandem_decode_layer(
                rows, x32.data_ptr(), arch.hidden_size, eps, in_norm, qkv, qkv_bias, o, o_bias, post_norm, gate_up,
                down, arch.intermediate_size, cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                meta.page_table.data_ptr(), meta.page_table.stride(0), meta.seq_lens.data_ptr(),
                meta.slot_mapping.data_ptr(), heads, kv_heads, head_dim, k_cache.shape[1], self._scale,
                scratch.data_ptr(), int(self.dtype == torch.bfloat16))
        return x32.to(self.dtype), tuple(entering)

    def _scratch_for(self, rows: int) -> torch.Tensor:
        arch = self.model.arch
        need = self._lib.tandem_decode_layer_scratch(rows, arch.hidden_size, *self._dims, arch.intermediate_size)
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.float32)
        return self._scratch


def _dense_mlp(layer: LlamaDecoderLayer) -> LlamaMLP:
    """`layer`'s MLP, dense where the C layer serves the model (`LlamaArch.plain_llama`: no experts)."""
    assert isinstance(layer.mlp, LlamaMLP), f"a {type(layer.mlp).__name__} MLP: the C layer serves plain Llamas alone"
    return layer.mlp
