"""RoPE's configuration as a checkpoint states it (v4 ``rope_theta`` / ``rope_scaling``, v5
``rope_parameters``, per layer type or not), resolved to `RopeScaling`; `kernels/model/rope.py`
turns it into frequencies."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. ``default`` ignores the other fields."""

    rope_type: str = "default"  # one of SUPPORTED_ROPE_TYPES
    factor: float = 1.0  # linear / llama3 / yarn: long wavelengths are divided by this
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 / yarn: pretraining context length
    beta_fast: float = 32.0  # yarn: rotations above which a dimension keeps its frequency
    beta_slow: float = 1.0  # yarn: rotations below which it is interpolated
    attention_factor: float | None = None  # yarn: cos and sin multiplied by this (None: from factor / mscale)
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn: the correction range rounded to whole dimensions

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope type {self.rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        assert self.factor > 0, f"rope scaling factor {self.factor} must be positive"


def resolve_rope(hf_config: Any, model_type: str) -> tuple[float, RopeScaling, float | None, float]:
    """(base, scaling, windowed layers' own base or None, partial rotary factor) of a config."""
    params = getattr(hf_config, "rope_parameters", None)
    local_theta = None
    if isinstance(params, dict) and "full_attention" in params:  # v5, per layer type (Gemma 3)
        local = params.get("sliding_attention") or {}
        if local and local.get("rope_type", "default") != "default":
            raise ValueError(f"windowed layers' rope type {local['rope_type']!r} is not supported (default only)")
        local_theta = float(local["rope_theta"]) if local else None
        params = params["full_attention"]
    elif model_type == "gemma3_text" and getattr(hf_config, "rope_local_base_freq", None) is not None:
        local_theta = float(hf_config.rope_local_base_freq)
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling: dict | None = params
    else:
        theta = float(getattr(hf_config, "rope_theta", None) or 10000.0)
        scaling = getattr(hf_config, "rope_scaling", None)
    partial = float((scaling or {}).get("partial_rotary_factor") or getattr(hf_config, "partial_rotary_factor", None)
                    or 1.0)
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor {partial} is not supported (RoPE over the whole head only)")
    return theta, _scaling(scaling or {}, hf_config), local_theta, partial


def _scaling(scaling: dict, hf_config: Any) -> RopeScaling:
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return RopeScaling()
    if rope_type == "linear":
        return RopeScaling(rope_type="linear", factor=float(scaling["factor"]))
    if rope_type == "llama3":
        return RopeScaling(
            rope_type="llama3",
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
    if rope_type == "yarn":
        original = int(scaling.get("original_max_position_embeddings") or hf_config.max_position_embeddings)
        factor = scaling.get("factor") or hf_config.max_position_embeddings / original
        optional = {name: float(scaling[name]) for name in ("attention_factor", "mscale", "mscale_all_dim")
                    if scaling.get(name) is not None}
        return RopeScaling(rope_type="yarn", factor=float(factor), original_max_position_embeddings=original,
                           beta_fast=float(scaling.get("beta_fast") or 32),
                           beta_slow=float(scaling.get("beta_slow") or 1),
                           truncate=bool(scaling.get("truncate", True)), **optional)
    return RopeScaling(rope_type=rope_type)  # raises: unsupported type
