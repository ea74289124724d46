"""LlamaArch: the Llama-family architecture, resolved once from a Hugging Face config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. ``default`` ignores the other fields."""

    rope_type: str = "default"  # one of SUPPORTED_ROPE_TYPES
    factor: float = 1.0  # linear / llama3: long wavelengths are divided by this
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only: pretraining context length

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope type {self.rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        assert self.factor > 0, f"rope scaling factor {self.factor} must be positive"


@dataclass(frozen=True)
class LlamaArch:
    """Shapes and constants of a Llama-family decoder (Llama, SmolLM, Qwen2, Mistral)."""

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
    sliding_window: int | None = None  # not applied: exact only for sequences shorter than this
    model_type: str = "llama"

    def __post_init__(self) -> None:
        assert self.num_heads % self.num_kv_heads == 0, (
            f"num_heads={self.num_heads} not a multiple of num_kv_heads={self.num_kv_heads}: bad config?"
        )
        assert self.head_dim % 2 == 0, f"head_dim={self.head_dim} must be even for rotate-half RoPE"

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> "LlamaArch":
        """Resolve a transformers config (v4 ``rope_theta``/``rope_scaling`` or v5 ``rope_parameters``)."""
        model_type = getattr(hf_config, "model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not Llama-family ({', '.join(SUPPORTED_MODEL_TYPES)})")
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported; Llama-family MLP uses silu")
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        rope_theta, rope_scaling = _resolve_rope(hf_config)
        qkv_bias, o_bias = _resolve_attention_bias(hf_config, model_type)
        return cls(
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf_config.rms_norm_eps),
            rope_theta=rope_theta,
            max_position_embeddings=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            o_proj_bias=o_bias,
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            rope_scaling=rope_scaling,
            sliding_window=_resolve_sliding_window(hf_config),
            model_type=model_type,
        )


def _resolve_attention_bias(hf_config: Any, model_type: str) -> tuple[bool, bool]:
    """(qkv bias, o_proj bias): Qwen2 has qkv bias only; Llama's flag covers all four."""
    if model_type == "qwen2":
        return True, False
    bias = bool(getattr(hf_config, "attention_bias", False))
    return bias, bias


def _resolve_sliding_window(hf_config: Any) -> int | None:
    if getattr(hf_config, "use_sliding_window", True) is False:
        return None
    return getattr(hf_config, "sliding_window", None)


def _resolve_rope(hf_config: Any) -> tuple[float, RopeScaling]:
    """Read RoPE base and scaling from either config generation."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling: dict | None = params
    else:
        theta = float(getattr(hf_config, "rope_theta", 10000.0))
        scaling = getattr(hf_config, "rope_scaling", None)
    if not scaling:
        return theta, RopeScaling()
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, RopeScaling()
    if rope_type == "linear":
        return theta, RopeScaling(rope_type="linear", factor=float(scaling["factor"]))
    if rope_type == "llama3":
        return theta, RopeScaling(
            rope_type="llama3",
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
    return theta, RopeScaling(rope_type=rope_type)  # raises: unsupported type
