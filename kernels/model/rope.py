"""Rotary position embedding, HF "rotate half" convention (not interleaved)."""

from __future__ import annotations

import math

import torch

from kernels.model.arch import LlamaArch, RopeScaling


def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """``[head_dim // 2]`` float32 inverse frequencies on the CPU (even under a meta device
    context), computed as transformers does."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim))
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3_scale(inv_freq, scaling)
    return inv_freq


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

    def __init__(self, arch: LlamaArch) -> None:
        self.max_positions = arch.max_position_embeddings
        self.inv_freq = inv_frequencies(arch.head_dim, arch.rope_theta, arch.rope_scaling)  # [hd/2] f32
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def _table(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (device, dtype)
        if key not in self._tables:
            pos = torch.arange(self.max_positions, dtype=torch.float32, device=device)  # [P]
            freqs = pos[:, None] * self.inv_freq.to(device)[None, :]  # [P, hd/2]
            emb = torch.cat((freqs, freqs), dim=-1)  # [P, hd]
            sin = emb.sin().to(dtype)
            sin[:, : sin.shape[1] // 2].neg_()  # exact: the sign rotate-half gives the first half
            self._tables[key] = (emb.cos().to(dtype), sin)
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
