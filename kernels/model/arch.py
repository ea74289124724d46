"""LlamaArch: a decoder-only transformer's shapes and variations, resolved once from a Hugging Face config.

One decoder serves every family here (`kernels/model/llama.py`); each family is a set of switches:

    family        what differs from Llama
    mistral       a sliding window on every layer (where the config names one)
    qwen2         q/k/v biases; a sliding window on the layers its config marks
    qwen3         RMS norms on each query and key head (`qk_norm`)
    phi3          q/k/v and gate/up stored fused in the checkpoint; a sliding window
    gemma2        GeGLU (tanh GELU), (1 + w) norms, embeddings scaled by sqrt(hidden), norms after the
                  attention and the MLP too, scores and logits soft-capped, windowed and global
                  layers alternating, scale from `query_pre_attn_scalar`
    gemma3_text   Gemma 2's, less the soft caps, plus q/k norms and a RoPE of its own on windowed layers
    mixtral       a sparse MoE MLP: top-k of E experts, weights renormalised
    qwen2_moe     Qwen2's, MoE MLPs with a gated shared expert
    qwen3_moe     Qwen3's, MoE MLPs
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kernels.model.rope_config import RopeScaling, resolve_rope

__all__ = ["LlamaArch", "RopeScaling", "SUPPORTED_MODEL_TYPES", "SUPPORTED_ACTIVATIONS"]

SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text",
                                          "mixtral", "qwen2_moe", "qwen3_moe")
SUPPORTED_ACTIVATIONS: tuple[str, ...] = ("silu", "gelu_pytorch_tanh")
_GEMMA = ("gemma2", "gemma3_text")
_MOE = ("mixtral", "qwen2_moe", "qwen3_moe")
_QUANT_HINT = "serve an unquantised (float32/bfloat16/float16) checkpoint"


@dataclass(frozen=True)
class LlamaArch:
    """Shapes and constants of a decoder of one of `SUPPORTED_MODEL_TYPES` (module docstring)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads; num_heads % num_kv_heads == 0 (GQA)
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int  # positions >= this are rejected by the RoPE table
    tie_word_embeddings: bool
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2: True)
    o_proj_bias: bool = False  # bias on o_proj (Llama attention_bias=True sets both)
    mlp_bias: bool = False
    rope_scaling: RopeScaling = RopeScaling()
    model_type: str = "llama"
    hidden_act: str = "silu"
    """The MLP's gate activation: `silu` (SwiGLU) or `gelu_pytorch_tanh` (GeGLU)."""
    qk_norm: bool = False
    """An RMS norm over each query and key head before RoPE (Qwen3, Gemma 3)."""
    gemma_norms: bool = False
    """Norms scale by (1 + w) in float32, then cast (Gemma); else cast, then scale by w (Llama)."""
    sandwich_norms: bool = False
    """Norms after the attention and after the MLP as well as before each (Gemma 2 and 3)."""
    embed_scale: float | None = None
    """Embeddings multiplied by this (Gemma: sqrt(hidden_size), rounded to the model's dtype)."""
    attention_scale: float | None = None
    """Scores scaled by this; None: head_dim ** -0.5."""
    attn_softcap: float | None = None
    """Scores soft-capped: cap * tanh(s / cap) (Gemma 2)."""
    final_softcap: float | None = None
    """Logits soft-capped the same way (Gemma 2)."""
    layer_windows: tuple[int | None, ...] = ()
    """Per layer: its sliding window (a token sees its last `window` positions), or None (global). ()
    for none windowed."""
    local_rope_theta: float | None = None
    """Windowed layers' own RoPE base, unscaled (Gemma 3's local layers); None: the model's RoPE."""
    partial_rotary_factor: float = 1.0
    num_experts: int = 0
    """Experts of each MoE layer; 0: a dense model."""
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    """The top-k routing weights renormalised to sum to 1 (Mixtral always; Qwen's config says)."""
    router_weights_float: bool = False
    """Routing weights kept in float32 (Mixtral); else rounded to the model's dtype (Qwen)."""
    shared_expert_intermediate_size: int = 0
    """A shared expert beside the routed ones, gated by a sigmoid (Qwen2-MoE); 0: none."""
    moe_layers: tuple[bool, ...] = ()
    """Per layer: its MLP is the MoE one. () for a dense model."""

    def __post_init__(self) -> None:
        assert self.num_heads % self.num_kv_heads == 0, (
            f"num_heads={self.num_heads} not a multiple of num_kv_heads={self.num_kv_heads}: bad config?"
        )
        assert self.head_dim % 2 == 0, f"head_dim={self.head_dim} must be even for rotate-half RoPE"
        assert not self.layer_windows or len(self.layer_windows) == self.num_layers, "one window per layer"
        assert not self.moe_layers or len(self.moe_layers) == self.num_layers, "one MoE flag per layer"
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_ACTIVATIONS)})")

    @property
    def scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else self.head_dim**-0.5

    @property
    def is_moe(self) -> bool:
        return any(self.moe_layers)

    def window_of(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def kv_window(self) -> int | None:
        """The widest sliding window when every layer has one (KV behind it is never read again), else None."""
        widths = [w for w in self.layer_windows if w is not None]
        return max(widths) if widths and len(widths) == len(self.layer_windows) else None

    @property
    def windowed(self) -> bool:
        """Some layer has a sliding window."""
        return any(w is not None for w in self.layer_windows)

    @property
    def plain_llama(self) -> bool:
        """Nothing beyond the Llama layer (SwiGLU, Llama norms, no q/k norm, windows, caps or experts):
        what kernels written for Llama alone (the CPU's C layers, EAGLE heads) take."""
        return (self.hidden_act == "silu" and not (self.qk_norm or self.gemma_norms or self.sandwich_norms)
                and self.embed_scale is None and self.attention_scale is None and self.attn_softcap is None
                and self.final_softcap is None and not self.windowed and not self.is_moe
                and self.partial_rotary_factor == 1.0)

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> LlamaArch:
        """Resolve a transformers config (v4 ``rope_theta``/``rope_scaling`` or v5 ``rope_parameters``),
        or config.json read as attributes. Raises ValueError naming what it found and what is supported."""
        model_type = getattr(hf_config, "model_type", "llama")
        _refuse_unsupported(hf_config, model_type)
        get = lambda name, default=None: _get(hf_config, name, default)  # noqa: E731
        act = get("hidden_activation") or get("hidden_act", "silu")
        if act == "gelu" and model_type in _GEMMA:
            act = "gelu_pytorch_tanh"  # Gemma's configs say "gelu" and mean the tanh approximation
        num_heads = hf_config.num_attention_heads
        head_dim = get("head_dim") or hf_config.hidden_size // num_heads
        num_layers = hf_config.num_hidden_layers
        rope_theta, rope_scaling, local_theta, partial = resolve_rope(hf_config, model_type)
        qkv_bias, o_bias = _resolve_attention_bias(hf_config, model_type)
        gemma = model_type in _GEMMA
        return cls(
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf_config.rms_norm_eps),
            rope_theta=rope_theta,
            max_position_embeddings=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(get("tie_word_embeddings", gemma)),
            attention_bias=qkv_bias,
            o_proj_bias=o_bias,
            mlp_bias=bool(get("mlp_bias", False)),
            rope_scaling=rope_scaling,
            model_type=model_type,
            hidden_act=act,
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
            gemma_norms=gemma,
            sandwich_norms=gemma,
            embed_scale=hf_config.hidden_size**0.5 if gemma else None,
            attention_scale=float(get("query_pre_attn_scalar")) ** -0.5 if gemma else None,
            attn_softcap=_positive(get("attn_logit_softcapping")) if gemma else None,
            final_softcap=_positive(get("final_logit_softcapping")) if gemma else None,
            layer_windows=_resolve_windows(hf_config, model_type, num_layers),
            local_rope_theta=local_theta,
            partial_rotary_factor=partial,
            **_resolve_moe(hf_config, model_type, num_layers),
        )


def _get(hf_config: Any, name: str, default: Any = None) -> Any:
    value = getattr(hf_config, name, None)
    return default if value is None else value


def _positive(value: Any) -> float | None:
    return float(value) if value else None


def _refuse_unsupported(hf_config: Any, model_type: str) -> None:
    if model_type == "gemma3":
        raise ValueError("model_type 'gemma3' is Gemma 3's multimodal checkpoint; tandem serves its text model "
                         "(model_type 'gemma3_text', e.g. gemma-3-1b) only")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    quant = getattr(hf_config, "quantization_config", None)
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else getattr(quant, "quant_method", "?")
        raise ValueError(f"the checkpoint is quantized ({method}); tandem loads no quantized weights: {_QUANT_HINT}")


def _resolve_attention_bias(hf_config: Any, model_type: str) -> tuple[bool, bool]:
    """(qkv bias, o_proj bias): Qwen2 and Qwen2-MoE have qkv bias only; others' flag covers all four."""
    if model_type in ("qwen2", "qwen2_moe"):
        return True, False
    bias = bool(_get(hf_config, "attention_bias", False))
    return bias, bias


def _resolve_windows(hf_config: Any, model_type: str, num_layers: int) -> tuple[int | None, ...]:
    """Per layer its sliding window or None, as transformers applies them: by `layer_types` where
    the config has them, else the one `sliding_window` on every layer (Mistral, Mixtral, Phi-3);
    Qwen's only with `use_sliding_window`, Gemma 2's on every other layer, Gemma 3's by its pattern."""
    window = _get(hf_config, "sliding_window")
    if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and not _get(hf_config, "use_sliding_window", False):
        return ()
    if not window:
        return ()
    types = _get(hf_config, "layer_types")
    if types is None and model_type == "gemma2":
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    elif types is None and model_type == "gemma3_text":
        pattern = int(_get(hf_config, "sliding_window_pattern", 6))
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]
    elif types is None and model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        first = int(_get(hf_config, "max_window_layers", num_layers))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if types is None:
        return (int(window),) * num_layers
    if len(types) != num_layers:
        raise ValueError(f"layer_types names {len(types)} layers, the model has {num_layers}")
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ValueError(f"layer types {unknown} are not supported (supported: sliding_attention, full_attention)")
    windows = tuple(int(window) if t == "sliding_attention" else None for t in types)
    return windows if any(w is not None for w in windows) else ()


def _resolve_moe(hf_config: Any, model_type: str, num_layers: int) -> dict[str, Any]:
    if model_type not in _MOE:
        return {}
    get = lambda name, default=None: _get(hf_config, name, default)  # noqa: E731
    if model_type == "mixtral":
        experts = int(get("num_local_experts"))
        return dict(num_experts=experts, num_experts_per_tok=int(get("num_experts_per_tok")),
                    moe_intermediate_size=hf_config.intermediate_size, norm_topk_prob=True,
                    router_weights_float=True, moe_layers=(True,) * num_layers)
    experts, step = int(get("num_experts") or get("num_local_experts")), int(get("decoder_sparse_step", 1))
    dense = set(get("mlp_only_layers", []) or [])
    layers = tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(num_layers))
    return dict(num_experts=experts, num_experts_per_tok=int(get("num_experts_per_tok")),
                moe_intermediate_size=int(get("moe_intermediate_size")),
                norm_topk_prob=bool(get("norm_topk_prob", False)),
                shared_expert_intermediate_size=int(get("shared_expert_intermediate_size", 0))
                if model_type == "qwen2_moe" else 0, moe_layers=layers if any(layers) else ())
