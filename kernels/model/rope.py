"""Rotary position embedding, HF "rotate half" convention (not interleaved)."""

from __future__ import annotations

import math

import torch

from kernels.model.arch import LlamaArch
from kernels.model.rope_config import RopeScaling


def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """``[head_dim // 2]`` float32 inverse frequencies on the CPU (even under a meta device
    context), computed as transformers does."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim))
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3_scale(inv_freq, scaling)
    if scaling.rope_type == "yarn":
        return _yarn_frequencies(head_dim, theta, scaling)
    return inv_freq


def attention_factor(scaling: RopeScaling) -> float:
    """What cos and sin are multiplied by: 1, but for yarn (its `attention_factor`, else derived from
    the factor and `mscale` / `mscale_all_dim` as the YaRN paper's code does)."""
    if scaling.rope_type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor

    def log_scale(m: float) -> float:
        return 1.0 if scaling.factor <= 1 else 0.1 * m * math.log(scaling.factor) + 1.0
    if scaling.mscale and scaling.mscale_all_dim:
        return log_scale(scaling.mscale) / log_scale(scaling.mscale_all_dim)
    return log_scale(1.0)


def _yarn_frequencies(head_dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    """YaRN: dimensions that turn many times over the pretraining context keep their frequency, those
    that turn less than once are interpolated (divided by the factor), a linear ramp between."""
    def dim_of(rotations: float) -> float:  # the dimension turning `rotations` times over the original context
        return (head_dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(theta)))
    low, high = dim_of(s.beta_fast), dim_of(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    base = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low)
            / (high - low if high != low else 0.001)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    return (1.0 / (s.factor * base)) * (1 - keep) + (1.0 / base) * keep


def _llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths / factor, short kept, a smooth ramp between."""
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryTable:
    """cos and signed sin for positions ``[0, max_position_embeddings)``, built lazily per (device, dtype).

    Values are computed in float32 and cast to the model dtype, exactly like transformers, so
    bf16/fp16 models round the same way the reference does. The sin table carries rotate-half's sign
    (its first half negated), so `apply_rotary` is one flip and three arithmetic ops.
    """

    def __init__(self, arch: LlamaArch, theta: float | None = None, scaling: RopeScaling | None = None) -> None:
        """The model's RoPE, or one of `theta` and `scaling` (Gemma 3's windowed layers' own)."""
        self.max_positions = arch.max_position_embeddings
        theta = arch.rope_theta if theta is None else theta
        scaling = arch.rope_scaling if scaling is None else scaling
        self.inv_freq = inv_frequencies(arch.head_dim, theta, scaling)  # [hd/2] f32
        self.factor = attention_factor(scaling)
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def _table(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (device, dtype)
        if key not in self._tables:
            pos = torch.arange(self.max_positions, dtype=torch.float32, device=device)  # [P]
            freqs = pos[:, None] * self.inv_freq.to(device)[None, :]  # [P, hd/2]
            emb = torch.cat((freqs, freqs), dim=-1)  # [P, hd]
            cos, sin = emb.cos(), emb.sin()
            if self.factor != 1.0:
                cos, sin = cos * self.factor, sin * self.factor
            sin = sin.to(dtype)
            sin[:, : sin.shape[1] // 2].neg_()  # exact: the sign rotate-half gives the first half
            self._tables[key] = (cos.to(dtype), sin)
        return self._tables[key]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions ``[T]`` int64 (each < max_position_embeddings; not checked: no sync) -> cos and
        signed sin ``[T, hd]``, as `apply_rotary` takes them."""
        cos, sin = self._table(positions.device, dtype)
        return cos[positions], sin[positions]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x ``[T, heads, hd]`` (q and k heads together, say), cos / signed sin ``[T, hd]`` from
    `RotaryTable.cos_sin` -> rotated ``[T, heads, hd]``.

    transformers computes ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = [-x2, x1]``;
    here the halves are swapped by one flip and the sign rides in the table: ``x2 * -sin1`` is the
    same float as ``-x2 * sin1``, so the result is bit-identical."""
    num_tokens, heads, head_dim = x.shape
    swapped = x.reshape(num_tokens, heads, 2, head_dim // 2).flip(2).view(num_tokens, heads, head_dim)
    return x * cos[:, None, :] + swapped * signed_sin[:, None, :]
