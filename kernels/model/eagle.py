"""EAGLE draft heads over tandem's paged KV (docs/design.md §6): the network that proposes draft tokens.

One module, two layouts, over the target's hidden size ``h``:

    eagle   (EAGLE-1/2)  x = fc([embed(token); feature])         fc [2h -> h] with bias
                         x = x + attn(x);  x = x + mlp(post_norm(x))   (the layer has no input norm)
                         logits = the target's lm_head(x) over the whole vocabulary
                         feature: the target's final-normed hidden; on later draft steps the draft's x
    eagle3  (EAGLE-3)    feature = fc([aux_0; aux_1; aux_2])      fc [3h -> h], no bias: the hidden
                         states entering three target layers; on later draft steps the draft's x
                         r = feature + attn([input_norm(embed(token)); hidden_norm(feature)])   (q/k/v read 2h)
                         x = r + mlp(post_norm(r))
                         logits = lm_head(norm(x)) over a reduced draft vocabulary; `token_map`
                         turns a draft id into the target's id

Rows, positions and KV slots are the target's: the draft row at position ``i`` is the pair (the
target's feature at ``i``, the token at ``i + 1``), and its K/V go to the same slot (page id and
offset) as the target's position ``i``, in a one-layer cache of its own (DESIGN §4 rule 5: every
move, load, eviction and free of those pages covers the draft's KV too). So one `AttnMetadata`
serves both models in a step.

Published checkpoints load with `load_eagle_checkpoint`: EAGLE-1/2 (``fc.*``, ``layers.0.*``) and
EAGLE-3 (``fc.weight``, ``midlayer.*``, ``norm.weight``, ``lm_head.weight``, ``d2t`` offsets).
"""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from kernels.attention import AttnMetadata
from kernels.kv_layout import KVCacheTensors
from kernels.model.arch import LlamaArch
from kernels.model.layers import LlamaMLP, RMSNorm
from kernels.model.llama import LlamaAttention
from kernels.model.packed_linear import PackedLinear, packed_linear_at
from kernels.model.rope import RotaryTable


class DraftStyle(str, enum.Enum):
    EAGLE = "eagle"
    EAGLE3 = "eagle3"


@dataclass(frozen=True)
class DraftArch:
    """A draft head's shapes: the target's decoder-layer shapes (`layer`, one layer) plus its own."""

    style: DraftStyle
    layer: LlamaArch  # num_layers == 1; hidden size and vocabulary are the target's
    draft_vocab_size: int  # == layer.vocab_size for `eagle` (it uses the target's lm_head)
    aux_layer_ids: tuple[int, ...] = ()  # eagle3: the target layers whose input hidden states feed fc

    def __post_init__(self):
        assert self.layer.num_layers == 1, f"a draft head has one decoder layer, got {self.layer.num_layers}"
        assert 1 <= self.draft_vocab_size <= self.layer.vocab_size, (
            f"draft vocabulary {self.draft_vocab_size} outside [1, {self.layer.vocab_size}]")
        if self.style is DraftStyle.EAGLE:
            assert self.draft_vocab_size == self.layer.vocab_size, "an eagle head predicts over the whole vocabulary"
        else:
            assert len(self.aux_layer_ids) == 3, f"eagle3 reads three target layers, got {self.aux_layer_ids}"

    @classmethod
    def for_target(cls, target: LlamaArch, style: DraftStyle, draft_vocab_size: int | None = None,
                   aux_layer_ids: tuple[int, ...] | None = None) -> DraftArch:
        """A head shaped like one layer of `target`; eagle3's aux layers default to 2, L // 2, L - 3."""
        n = target.num_layers
        if style is DraftStyle.EAGLE3 and aux_layer_ids is None:
            aux_layer_ids = (min(2, n - 1), n // 2, max(n - 3, 0))
        return cls(style, dataclasses.replace(target, num_layers=1), draft_vocab_size or target.vocab_size,
                   tuple(aux_layer_ids or ()))

    @property
    def feature_size(self) -> int:
        """Width of what the target hands the draft per token: its hidden (eagle), three (eagle3)."""
        h = self.layer.hidden_size
        return h if self.style is DraftStyle.EAGLE else 3 * h


class EagleDraftHead(nn.Module):
    """See the module docstring. The token embedding and (eagle) the lm_head are the target's,
    passed in by reference (`embed`, `target_lm_head`), never copied. With `tp` (a rank of a
    tensor-parallel target, `kernels/model/tp.py`) the head is sharded as a decoder layer is: its
    heads and MLP columns, its attention's and MLP's outputs summed over the ranks; the target's
    embedding and lm_head are vocabulary-parallel; `fc`, the norms and an eagle3 lm_head are whole."""

    def __init__(self, arch: DraftArch, embed: nn.Embedding, target_lm_head: PackedLinear | None = None,
                 backend=None, tp=None) -> None:
        super().__init__()
        self.arch, self.tp = arch, tp
        layer, h = arch.layer if tp is None else tp.shard.local_arch(arch.layer), arch.layer.hidden_size
        eagle3 = arch.style is DraftStyle.EAGLE3
        self.embed = embed  # the target's; not a parameter of this head's checkpoint
        self.fc = PackedLinear(arch.feature_size if eagle3 else 2 * h, (h,), bias=not eagle3)
        self.self_attn = LlamaAttention(layer, backend) if backend is not None else LlamaAttention(layer, _torch())
        if eagle3:  # q/k/v read [input_norm(embed); hidden_norm(feature)]
            q_dim, kv_dim = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
            self.self_attn.qkv_proj = PackedLinear(2 * h, (q_dim, kv_dim, kv_dim), bias=layer.attention_bias)
            self.input_layernorm = RMSNorm(h, layer.rms_norm_eps)
            self.hidden_norm = RMSNorm(h, layer.rms_norm_eps)
            self.norm = RMSNorm(h, layer.rms_norm_eps)
            self.lm_head = PackedLinear(h, (arch.draft_vocab_size,), bias=False)
        else:
            assert target_lm_head is not None, "an eagle head predicts through the target's lm_head"
            self.lm_head = target_lm_head
        self.mlp = LlamaMLP(layer)
        self.post_attention_layernorm = RMSNorm(h, layer.rms_norm_eps)
        self.rotary = RotaryTable(layer)
        # draft id -> target id; the identity for a whole-vocabulary head
        self.register_buffer("token_map", torch.arange(arch.draft_vocab_size), persistent=False)

    def combine(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """eagle3: ``[T, 3h]`` hidden states entering the aux layers -> the feature ``[T, h]``."""
        assert self.arch.style is DraftStyle.EAGLE3, "only an eagle3 head combines aux hidden states"
        return self.fc(aux_hidden)

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64: the token after each row's position
        features: torch.Tensor,  # [T, h]: eagle3 -> `combine`d or the draft's own x; eagle -> hidden
        positions: torch.Tensor,  # [T] int64
        meta: AttnMetadata,
        kv_cache: KVCacheTensors,  # one layer, the target's pages; mutated at meta.slot_mapping
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns x ``[T, h]`` (the next draft step's feature) and float32 draft logits
        ``[num_logits, draft_vocab]`` for rows ``meta.logits_indices`` (`token_map` maps their ids)."""
        assert kv_cache.num_layers == 1, f"a draft head's KV has one layer, got {kv_cache.num_layers}"
        emb = self._embed(input_ids)  # [T, h]
        cos, sin = self.rotary.cos_sin(positions, emb.dtype)
        residual, attn_in = self._attn_input(emb, features)
        r = residual + self._summed(self.self_attn(attn_in, cos, sin, meta, kv_cache.k[0], kv_cache.v[0]))
        x = r + self._summed(self.mlp(self.post_attention_layernorm(r)))
        return x, self.draft_logits(x[meta.logits_indices])

    @torch.no_grad()
    def write_kv(self, input_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                 slot_mapping: torch.Tensor, kv_cache: KVCacheTensors) -> None:
        """Only the K/V `forward` would write for these rows (at ``slot_mapping``): for rows whose
        output nothing reads, such as a catch-up's rows before each sequence's last. A row's K/V
        depend on its own token, feature and position alone."""
        emb = self._embed(input_ids)
        cos, sin = self.rotary.cos_sin(positions, emb.dtype)
        _, k, v = self.self_attn.project(self._attn_input(emb, features)[1], cos, sin)
        self.self_attn.backend.write_kv(kv_cache.k[0], kv_cache.v[0], k, v, slot_mapping)

    def _attn_input(self, emb: torch.Tensor, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the residual the attention output adds to, the attention's input) ``[T, h]``, ``[T, h or 2h]``."""
        if self.arch.style is DraftStyle.EAGLE3:
            return features, torch.cat((self.input_layernorm(emb), self.hidden_norm(features)), dim=-1)
        x = self.fc(torch.cat((emb, features), dim=-1))
        return x, x

    def draft_logits(self, x: torch.Tensor) -> torch.Tensor:
        """float32 draft logits ``[n, draft_vocab]`` of features ``x [n, h]`` (eagle3: through its own
        final norm and lm_head; eagle: the target's lm_head)."""
        if self.arch.style is DraftStyle.EAGLE3:
            return self.lm_head(self.norm(x)).float()
        logits = self.lm_head(x)
        return (logits if self.tp is None else self.tp.gather_vocab(logits, self.arch.layer.vocab_size)).float()

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids) if self.tp is None else self.tp.embed(self.embed, input_ids)

    def _summed(self, partial: torch.Tensor) -> torch.Tensor:
        return partial if self.tp is None else self.tp.all_reduce(partial)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.token_map[draft_ids]

    def load_published(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load a published state dict by its names (q/k/v and gate/up packed, cast to this head's
        dtype). Tensors of the target a checkpoint may carry (embed_tokens, an eagle head's unused
        input_layernorm) are ignored; a missing or misshapen tensor raises ValueError. Sharded
        (`tp`): cut to this rank's part as a target layer's tensors are."""
        if self.tp is not None:
            tensors = _shard_head(tensors, self.arch, self.tp.shard)
        style, loaded = self.arch.style, {}
        for ours, names in _published_linears(style).items():
            module = packed_linear_at(self, ours)
            weights = [_take(tensors, n + ".weight") for n in names]
            biases = [_take(tensors, n + ".bias") for n in names] if module.bias is not None else None
            for key, value in PackedLinear.pack(weights, biases, module, module.weight.device).items():
                _check_shape(f"{ours}.{key}", value, getattr(module, key))
                loaded[f"{ours}.{key}"] = value
        for ours, name in _published_norms(style).items():
            param = self.get_parameter(ours + ".weight")
            value = _take(tensors, name + ".weight").to(param.dtype)
            _check_shape(ours, value, param)
            loaded[ours + ".weight"] = value
        if "d2t" in tensors:  # offsets: target id = draft id + d2t[draft id]
            self.token_map = torch.arange(self.arch.draft_vocab_size) + tensors["d2t"].long()
        self.load_state_dict(loaded, strict=False, assign=True)


def _torch():
    from kernels.attention import get_backend

    return get_backend("torch")


# ---- published checkpoints ---------------------------------------------------------------------
_LAYER_PREFIX = {DraftStyle.EAGLE: "layers.0.", DraftStyle.EAGLE3: "midlayer."}
_LAYER_LINEARS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                  "self_attn.o_proj": ("self_attn.o_proj",), "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
                  "mlp.down_proj": ("mlp.down_proj",)}


def _published_linears(style: DraftStyle) -> dict[str, tuple[str, ...]]:
    """Our PackedLinear -> the checkpoint Linear names it packs, in order."""
    pre = _LAYER_PREFIX[style]
    names = {ours: tuple(pre + part for part in parts) for ours, parts in _LAYER_LINEARS.items()}
    names["fc"] = ("fc",)
    if style is DraftStyle.EAGLE3:
        names["lm_head"] = ("lm_head",)
    return names


def _published_norms(style: DraftStyle) -> dict[str, str]:
    """Our RMSNorm -> the checkpoint's name for it."""
    pre = _LAYER_PREFIX[style]
    norms = {"post_attention_layernorm": pre + "post_attention_layernorm"}
    if style is DraftStyle.EAGLE3:
        norms |= {"input_layernorm": pre + "input_layernorm", "hidden_norm": pre + "hidden_norm", "norm": "norm"}
    return norms


def _shard_head(tensors: dict[str, torch.Tensor], arch: DraftArch, shard) -> dict[str, torch.Tensor]:
    """A head's published tensors cut to `shard`'s part (its layer's as a target layer's; an eagle3
    head's own lm_head, over the draft vocabulary, whole)."""
    from kernels.model.hf_names import shard_tensors

    whole = {name: t for name, t in tensors.items() if name == "lm_head.weight"}
    return {**shard_tensors({n: t for n, t in tensors.items() if n not in whole}, arch.layer, shard), **whole}


def _take(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in tensors:
        raise ValueError(f"the EAGLE checkpoint has no {name!r} (not an EAGLE-1/2 or EAGLE-3 head?)")
    return tensors[name]


def _check_shape(name: str, value: torch.Tensor, param: torch.Tensor) -> None:
    if value.shape != param.shape:
        raise ValueError(f"EAGLE checkpoint {name}: shape {tuple(value.shape)} does not fit {tuple(param.shape)} "
                         "(a head for another model?)")


def checkpoint_style(config: dict) -> DraftStyle:
    """EAGLE-3 checkpoints name their architecture `LlamaForCausalLMEagle3` (or carry a draft vocabulary)."""
    architectures = " ".join(config.get("architectures") or ())
    return DraftStyle.EAGLE3 if "Eagle3" in architectures or "draft_vocab_size" in config else DraftStyle.EAGLE


def load_eagle_checkpoint(path: Path, target: LlamaArch, embed: nn.Embedding, target_lm_head: PackedLinear,
                          backend=None, tp=None) -> EagleDraftHead:
    """A published EAGLE-1/2 or EAGLE-3 head for `target` (the whole model's shapes) from a directory
    with config.json and `*.safetensors` or `pytorch_model.bin`; with `tp`, this rank's shard of it.
    Raises ValueError when its shapes do not fit `target`."""
    config = json.loads((path / "config.json").read_text())
    style = checkpoint_style(config)
    if config.get("hidden_size", target.hidden_size) != target.hidden_size:
        raise ValueError(f"{path}: draft hidden size {config['hidden_size']} != the target's {target.hidden_size}")
    aux = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    arch = DraftArch.for_target(target, style, config.get("draft_vocab_size"),
                                tuple(aux) if aux is not None else None)
    head = EagleDraftHead(arch, embed, target_lm_head if style is DraftStyle.EAGLE else None, backend, tp)
    head.to(dtype=embed.weight.dtype)  # the checkpoint's tensors are cast to the target's dtype
    head.load_published(_read_tensors(path))
    return head.to(device=embed.weight.device)


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    shards = sorted(path.glob("*.safetensors"))
    if shards:
        from safetensors.torch import load_file

        return {k: v for shard in shards for k, v in load_file(str(shard)).items()}
    bin_path = path / "pytorch_model.bin"
    if not bin_path.is_file():
        raise FileNotFoundError(f"{path}: no *.safetensors and no pytorch_model.bin")
    return torch.load(bin_path, map_location="cpu", weights_only=True)
