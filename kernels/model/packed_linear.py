"""Linear layers stored as one transposed weight, and the HF checkpoint names they pack.

Why transposed: on CPU, `x @ weight_t` runs 2-5x faster than `F.linear(x, weight)` for the
few-row matmuls of decode (4-16 rows: MKL's path for a transposed right operand is slow there),
and is no slower for prefill; on CUDA both layouts run at the same speed. Packing q/k/v and
gate/up into one matmul halves the number of weight passes per layer.
"""

from __future__ import annotations

import torch
from torch import nn


class PackedLinear(nn.Module):
    """`len(out_features)` HF Linear layers over the same input, as one matmul.

    weight_t: [in_features, sum(out_features)]; bias: [sum(out_features)] or None.
    """

    def __init__(self, in_features: int, out_features: tuple[int, ...], bias: bool) -> None:
        super().__init__()
        self.out_features = tuple(out_features)
        self.weight_t = nn.Parameter(torch.empty(in_features, sum(out_features)))
        self.bias = nn.Parameter(torch.zeros(sum(out_features))) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[T, in_features] -> [T, sum(out_features)]; `split` cuts it into the parts."""
        if self.bias is None:
            return x @ self.weight_t
        return torch.addmm(self.bias, x, self.weight_t)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return y.split(self.out_features, dim=-1)

    @staticmethod
    def pack(weights: list[torch.Tensor], biases: list[torch.Tensor] | None, like: "PackedLinear",
             device: torch.device) -> dict[str, torch.Tensor]:
        """HF [out_i, in] weights (and [out_i] biases) -> this module's parameters, cast like `like`."""
        dtype = like.weight_t.dtype
        in_features = weights[0].shape[1]
        weight_t = torch.empty(in_features, sum(w.shape[0] for w in weights), dtype=dtype, device=device)
        start = 0
        for w in weights:  # one strided copy per part: ~2x faster than cat-then-transpose
            weight_t[:, start:start + w.shape[0]].copy_(w.t())
            start += w.shape[0]
        packed = {"weight_t": weight_t}
        if biases is not None:
            packed["bias"] = torch.cat(biases, 0).to(device=device, dtype=dtype)
        return packed
