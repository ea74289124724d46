"""The decoder over a ragged batch with paged KV: Llama and the families `LlamaArch` describes
(Mistral, Qwen2/3, Phi-3, Gemma 2/3, Mixtral, Qwen2/3-MoE), each a set of switches on one layer.

Module names follow transformers' ``LlamaForCausalLM`` except that q/k/v and gate/up are packed
into one transposed matmul each (``PackedLinear``); ``load_hf_state_dict`` maps HF names. The
forward takes flat tensors (no batch axis): T new tokens of B sequences, described by
``AttnMetadata``; per-layer K/V are written to the paged cache before attention reads it.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.attention import AttentionBackend, AttnMetadata, get_backend
from kernels.kv_layout import KVCacheTensors
from kernels.model.arch import LlamaArch
from kernels.model.hf_names import ignored_key, shard_tensors, v5_names
from kernels.model.hf_names import packing as hf_packing
from kernels.model.layers import LlamaMLP, RMSNorm, SparseMoeMLP
from kernels.model.packed_linear import PackedLinear, packed_linear_at
from kernels.model.rope import RotaryTable, apply_rotary
from kernels.model.rope_config import RopeScaling
from kernels.model.tp import TPGroup

__all__ = ["LlamaArch", "LlamaForCausalLM"]


class LlamaAttention(nn.Module):
    def __init__(self, arch: LlamaArch, backend: AttentionBackend, layer: int = 0) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.scale = arch.scale
        self.window, self.softcap = arch.window_of(layer), arch.attn_softcap
        self.rope_index = 1 if self.window is not None and arch.local_rope_theta is not None else 0
        """Which of the model's RoPE tables it reads (1: the windowed layers' own, Gemma 3)."""
        self.backend = backend
        q_dim, kv_dim = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        self.qkv_proj = PackedLinear(arch.hidden_size, (q_dim, kv_dim, kv_dim), bias=arch.attention_bias)
        self.o_proj = PackedLinear(q_dim, (arch.hidden_size,), bias=arch.o_proj_bias)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if arch.qk_norm:
            self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, arch.gemma_norms)
            self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, arch.gemma_norms)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, hd]
        sin: torch.Tensor,  # [T, hd]
        meta: AttnMetadata,
        k_cache: torch.Tensor,  # [num_pages, page_size, kvh, hd], mutated: new tokens' slots
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        q, k, v = self.project(x, cos, sin)
        self.backend.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        if self.window is None and self.softcap is None:
            o = self.backend.attention(q, k_cache, v_cache, meta, self.scale)  # [T, H, hd]
        else:
            o = self.backend.attention(q, k_cache, v_cache, meta, self.scale, window=self.window, softcap=self.softcap)
        return self.o_proj(o.reshape(x.shape[0], self.num_heads * self.head_dim))

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[T, H, hd]``, k and v ``[T, kvh, hd]`` of ``x [T, hidden]`` (q and k rotated)."""
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (H + 2 kvh) hd]
        qk_dim = (self.num_heads + self.num_kv_heads) * self.head_dim
        if cos.dim() == 3:  # [tables, T, hd]: the model has more than one RoPE
            cos, sin = cos[self.rope_index], sin[self.rope_index]
        if self.q_norm is not None:  # each head normed before RoPE (Qwen3, Gemma 3)
            assert self.k_norm is not None, "q_norm without k_norm: both come from arch.qk_norm"
            q_dim = self.num_heads * self.head_dim
            q = apply_rotary(self.q_norm(qkv[:, :q_dim].view(num_tokens, self.num_heads, self.head_dim)), cos, sin)
            k = apply_rotary(self.k_norm(qkv[:, q_dim:qk_dim].view(num_tokens, self.num_kv_heads, self.head_dim)),
                             cos, sin)
            return q, k, qkv[:, qk_dim:].view(num_tokens, self.num_kv_heads, self.head_dim)
        # q and k heads rotate in one call: they are adjacent in the packed output
        qk = apply_rotary(qkv[:, :qk_dim].view(num_tokens, -1, self.head_dim), cos, sin)  # [T, H + kvh, hd]
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)  # [T, H, hd], [T, kvh, hd]
        return q, k, qkv[:, qk_dim:].view(num_tokens, self.num_kv_heads, self.head_dim)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: LlamaArch, backend: AttentionBackend, layer: int = 0, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp
        """Its tensor-parallel group: the attention's and the MLP's outputs are partial sums (`kernels/model/tp.py`)."""
        self.self_attn = LlamaAttention(arch, backend, layer)
        self.mlp = SparseMoeMLP(arch) if arch.moe_layers and arch.moe_layers[layer] else LlamaMLP(arch)
        norm = lambda: RMSNorm(arch.hidden_size, arch.rms_norm_eps, arch.gemma_norms)  # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm: RMSNorm | None = None
        self.post_feedforward_layernorm: RMSNorm | None = None
        if arch.sandwich_norms:  # Gemma: post_attention_layernorm norms the attention's output
            self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()

    def forward(self, x, cos, sin, meta, k_cache, v_cache) -> torch.Tensor:
        attended = self._summed(self.self_attn(self.input_layernorm(x), cos, sin, meta, k_cache, v_cache))
        if self.pre_feedforward_layernorm is None:
            x = x + attended
            return x + self._summed(self.mlp(self.post_attention_layernorm(x)))
        assert self.post_feedforward_layernorm is not None, "pre- but no post-feedforward norm: both are sandwich_norms"
        x = x + self.post_attention_layernorm(attended)
        return x + self.post_feedforward_layernorm(self._summed(self.mlp(self.pre_feedforward_layernorm(x))))

    def _summed(self, partial: torch.Tensor) -> torch.Tensor:
        return partial if self.tp is None else self.tp.all_reduce(partial)


class LlamaModel(nn.Module):
    def __init__(self, arch: LlamaArch, backend: AttentionBackend, tp: TPGroup | None = None,
                 vocab_rows: int | None = None) -> None:
        super().__init__()
        rows = arch.vocab_size if vocab_rows is None else vocab_rows
        weight = torch.empty(rows, arch.hidden_size)
        if not weight.is_meta:  # nn.Embedding's own init; a model made on meta is loaded, not initialised
            nn.init.normal_(weight)  # (on meta that init would import torch._dynamo: seconds of a worker's start)
        self.embed_tokens = nn.Embedding(rows, arch.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(LlamaDecoderLayer(arch, backend, i, tp) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, arch.gemma_norms)

    def decoder_layers(self) -> tuple[LlamaDecoderLayer, ...]:
        """`layers` as their class (nn.ModuleList types its items as plain Modules); not for a step's hot path."""
        layers = tuple(layer for layer in self.layers if isinstance(layer, LlamaDecoderLayer))
        assert len(layers) == len(self.layers), "a layer that is not a LlamaDecoderLayer: model.layers replaced?"
        return layers


def run_layers(layers: tuple[LlamaDecoderLayer, ...], x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               meta: AttnMetadata, k_caches: tuple[torch.Tensor, ...], v_caches: tuple[torch.Tensor, ...],
               keep_entering: bool) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Consecutive decoder layers (a function of the layers, so one compiled form serves every group of
    as many): their output, and with `keep_entering` the hidden state entering each one (else ())."""
    entering = []
    for layer, k_cache, v_cache in zip(layers, k_caches, v_caches):
        if keep_entering:
            entering.append(x)
        x = layer(x, cos, sin, meta, k_cache, v_cache)
    return x, tuple(entering)


def run_head(model: LlamaForCausalLM, x: torch.Tensor, logits_indices: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The final norm of every row, and float32 logits of rows `logits_indices`."""
    hidden = model.model.norm(x)
    return hidden, model.compute_logits(hidden[logits_indices])


class LlamaForCausalLM(nn.Module):
    """Ragged-batch Llama forward over paged KV. Loads HF checkpoints with ``load_hf_state_dict``."""

    def __init__(self, arch: LlamaArch, backend: AttentionBackend | None = None, tp: TPGroup | None = None) -> None:
        """`tp`: this rank's tensor-parallel group; the model then holds its shard (`kernels/model/tp.py`):
        `arch` is its own part's (heads, columns), `full_arch` the whole model's."""
        super().__init__()
        self.full_arch, self.tp = arch, tp
        arch = arch if tp is None else tp.shard.local_arch(arch)
        self.arch = arch
        self.backend = backend if backend is not None else get_backend("torch")
        vocab_rows = None if tp is None else len(tp.shard.vocab)
        self.model = LlamaModel(arch, self.backend, tp, vocab_rows)
        # Tied checkpoints: `load_hf_state_dict` makes lm_head's weight the embedding itself (one tensor).
        self.lm_head = PackedLinear(arch.hidden_size, (vocab_rows or arch.vocab_size,), bias=False)
        self.rotary = RotaryTable(arch)
        self.local_rotary = RotaryTable(arch, arch.local_rope_theta, RopeScaling()) if arch.local_rope_theta else None

    def use_attention_backend(self, backend: AttentionBackend) -> None:
        """Attend through `backend` from now on, in every layer (the engine's choice, made once when it
        is built: `engine.build.choose_attention_backend`)."""
        self.backend = backend
        for layer in self.model.decoder_layers():
            layer.self_attn.backend = backend

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64, position of each token within its sequence
        meta: AttnMetadata,
        kv_cache: KVCacheTensors,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns final-normed hidden ``[T, hidden]`` (model dtype) and float32 logits
        ``[num_logits, vocab]`` for rows ``meta.logits_indices``. Mutates ``kv_cache`` at
        ``meta.slot_mapping`` in every layer; nothing else."""
        hidden, logits, _ = self.forward_with_aux(input_ids, positions, meta, kv_cache, ())
        return hidden, logits

    @torch.no_grad()
    def forward_with_aux(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata,
                         kv_cache: KVCacheTensors, aux_layer_ids: tuple[int, ...], layers_fn=run_layers,
                         head_fn=run_head, group_size: int = 1,
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`forward`, plus the hidden states entering layers `aux_layer_ids` (each the previous layer's
        output; layer 0's is the embedding), concatenated in that order: ``[T, len(ids) * hidden]``,
        or None for no ids. EAGLE-3 draft heads read them (`kernels/model/eagle.py`).
        `layers_fn` / `head_fn`: `run_layers` / `run_head` or their compiled forms (`kernels/cpu/compiled.py`),
        `layers_fn` called on `group_size` layers at a time (it must divide the layer count)."""
        assert kv_cache.num_layers == self.arch.num_layers, (
            f"KV cache has {kv_cache.num_layers} layers, model {self.arch.num_layers}: cache built for another model?"
        )
        assert all(0 <= i < self.arch.num_layers for i in aux_layer_ids), f"aux layers {aux_layer_ids} out of range"
        assert self.arch.num_layers % group_size == 0, \
            f"groups of {group_size} do not divide {self.arch.num_layers} layers"
        x = self.model.embed_tokens(input_ids) if self.tp is None else self.tp.embed(self.model.embed_tokens, input_ids)
        if self.arch.embed_scale is not None:
            x = x * torch.tensor(self.arch.embed_scale, dtype=x.dtype)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)  # [T, hd] each; sin signed for apply_rotary
        if self.local_rotary is not None:  # [2, T, hd]: each layer reads its own (`LlamaAttention.rope_index`)
            local_cos, local_sin = self.local_rotary.cos_sin(positions, x.dtype)
            cos, sin = torch.stack((cos, local_cos)), torch.stack((sin, local_sin))
        layers, entering = tuple(self.model.layers), []
        for start in range(0, len(layers), group_size):
            end = start + group_size
            x, into = layers_fn(layers[start:end], x, cos, sin, meta, tuple(kv_cache.k[start:end]),
                                tuple(kv_cache.v[start:end]), bool(aux_layer_ids))
            entering.extend(into)
        hidden, logits = head_fn(self, x, meta.logits_indices)  # [T, hidden], [num_logits, vocab]
        aux = torch.cat([entering[i] for i in aux_layer_ids], dim=-1) if aux_layer_ids else None
        return hidden, logits, aux

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` final-normed states -> float32 ``[N, vocab]`` (soft-capped where the model caps them)."""
        logits = self.lm_head(hidden)
        if self.tp is not None:
            logits = self.tp.gather_vocab(logits, self.arch.vocab_size)
        cap = self.arch.final_softcap
        return (logits if cap is None else torch.tanh(logits / cap) * cap).float()

    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor], device: torch.device | str | None = None) -> None:
        """Load HF ``LlamaForCausalLM`` weights by name, strictly, packing them (see PackedLinear).

        ``lm_head.weight`` may be absent when embeddings are tied (it is ignored if present);
        ``*.rotary_emb.inv_freq`` buffers of old checkpoints are ignored. Tensors are cast to each
        parameter's dtype. ``device``: where the parameters go, each tensor moved there as it is taken
        (one module's parts at a time beside what is loaded: the checkpoint itself can stay on the
        host); None: a parameter on the meta device takes the tensor's device, others keep theirs.
        """
        given = {k: v for k, v in v5_names(state_dict, self.full_arch).items() if not ignored_key(k, self.arch)}
        if self.tp is not None:
            given = shard_tensors(given, self.full_arch, self.tp.shard)
        packing = hf_packing(self.arch)
        direct = [n for n, _ in self.named_parameters() if not n.endswith((".weight", ".bias")) or
                  n.rsplit(".", 1)[0] not in packing]
        expected = set(direct)
        for module_name, parts in packing.items():
            module = packed_linear_at(self, module_name)
            for part in parts:
                expected.add(part + ".weight")
                if module.bias is not None:
                    expected.add(part + ".bias")
        _check_keys(expected, set(given))
        loaded = {}
        for name in direct:
            loaded[name] = self._cast_like(given[name], self.get_parameter(name), name, device)
        for module_name, parts in packing.items():
            module = packed_linear_at(self, module_name)
            target = self._target_device(module.weight, given[parts[0] + ".weight"], device)
            weights = [given[p + ".weight"] for p in parts]
            biases = [given[p + ".bias"] for p in parts] if module.bias is not None else None
            self._check_shape(module_name, torch.Size((sum(w.shape[0] for w in weights), weights[0].shape[1])),
                              module.weight.shape)
            for key, tensor in PackedLinear.pack(weights, biases, module, target).items():
                loaded[f"{module_name}.{key}"] = tensor
        self.load_state_dict(loaded, strict=True, assign=True)
        if self.arch.tie_word_embeddings:  # the same [vocab, hidden] values: hold them once
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def _target_device(param: torch.Tensor, tensor: torch.Tensor, device: torch.device | str | None) -> torch.device:
        if device is not None:
            return torch.device(device)
        return tensor.device if param.is_meta else param.device

    def _cast_like(self, tensor: torch.Tensor, param: torch.Tensor, name: str,
                   device: torch.device | str | None) -> torch.Tensor:
        """`tensor` as `param`'s dtype on the load's device, in memory of its own: a checkpoint read
        with mmap would otherwise stay mapped (and resident) whole for as long as one of its tensors lives."""
        self._check_shape(name, tensor.shape, param.shape)
        out = tensor.to(device=self._target_device(param, tensor, device), dtype=param.dtype)
        return out.clone() if out.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr() else out

    @staticmethod
    def _check_shape(name: str, checkpoint: torch.Size, model: torch.Size) -> None:
        if tuple(checkpoint) != tuple(model):
            raise ValueError(f"weight {name}: checkpoint shape {tuple(checkpoint)} != model {tuple(model)}")


def _check_keys(expected: set[str], given: set[str]) -> None:
    missing, unexpected = sorted(expected - given), sorted(given - expected)
    if missing or unexpected:
        raise ValueError(
            f"state dict does not match the Llama architecture: missing {len(missing)} {missing[:5]}, "
            f"unexpected {len(unexpected)} {unexpected[:5]} (wrong model_type, or a non-HF naming?)"
        )
