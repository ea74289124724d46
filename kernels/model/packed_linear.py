"""Linear layers packed into one matmul each, and the HF checkpoint names they pack.

Packing q/k/v and gate/up into one matmul halves the number of weight passes per layer. The weight
keeps HF's layout, `weight [sum(out_features), in_features]`, the parts stacked along the rows.

On a CPU with oneDNN (torch's mkldnn), `prepack_cpu` goes further for inference: each float32
(and, where the CPU has native bf16 dot products, bfloat16) weight is also stored in oneDNN's
blocked layout for its matmul, reordered once, so no call re-packs it and every call splits the
weight over all of torch's threads. That is most of an eager decode step on a CPU, and packing
speeds it up at every row count, most at a few rows (MKL's one-row vector path keeps to one
thread; docs/results.md#cpu-decode). The packed copy
serves any row count (the layout is chosen for `_CPU_PACK_ROWS_HINT` rows but is correct for all:
checked once per process), holds about as much memory as the weight, and is bypassed as soon as the
weight is replaced or changed in place, under autograd and inside `torch.compile`, so it never
serves stale weights.

Inside `torch.compile` one row (a compiled single-request decode step) is written as a product
and a sum over each weight row, which inductor turns into one fused, vectorised pass over the
weight split across the threads, faster than oneDNN's for one row (a matrix-vector product is a
pass over the weight; this one runs closer to the memory's speed). That needs the rows contiguous,
hence HF's layout.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu import native as cpu_native

_CPU_PACK_ROWS_HINT = 16
"""Row count oneDNN is told when packing; the layout it gives serves every row count
(`cpu_packing_available`). 16 measured best from 1 to 512 rows (docs/results.md#cpu-decode)."""


class PackedLinear(nn.Module):
    """`len(out_features)` HF Linear layers over the same input, as one matmul.

    weight: [sum(out_features), in_features] (the parts' HF weights stacked); bias: [sum(out_features)] or None.
    """

    def __init__(self, in_features: int, out_features: tuple[int, ...], bias: bool) -> None:
        super().__init__()
        self.out_features = tuple(out_features)
        # typed as nn.Linear types its weight: a tied lm_head takes nn.Embedding's (a Parameter the stubs call Tensor)
        self.weight: torch.Tensor = nn.Parameter(torch.empty(sum(out_features), in_features))
        self.bias = nn.Parameter(torch.zeros(sum(out_features))) if bias else None
        self._cpu_packed: tuple[torch.Tensor, tuple] | None = None  # (packed copy, (weight ref, its state))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[T, in_features] -> [T, sum(out_features)]; `split` cuts it into the parts."""
        packed = self._cpu_packed
        if (packed is not None and x.dim() == 2 and x.shape[0] and not torch.is_grad_enabled()
                and not torch.compiler.is_compiling()):
            if self.is_prepacked:
                return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed[0], self.bias, "none", [], "")
            self._cpu_packed = None  # the weight changed since it was packed
        if x.dim() == 2 and x.shape[0] == 1 and torch.compiler.is_compiling() and x.device.type == "cpu":
            out = (self.weight * x).sum(-1)[None]  # one fused pass over the weight (module docstring)
            return out if self.bias is None else out + self.bias
        if _bf16_without_dot_products(x, self.weight):  # see WIDEN_MIN_ROWS
            if x.shape[0] >= WIDEN_MIN_ROWS:
                bias = None if self.bias is None else self.bias.float()
                return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)
            native = cpu_native.linear_bf16(x, self.weight, self.bias)  # None: no kernel here for this layout
            if native is not None:
                return native
        return F.linear(x, self.weight, self.bias)

    def __getstate__(self) -> dict:
        """Copies and pickles leave the packed copy behind (it is of this module's weight)."""
        return {**super().__getstate__(), "_cpu_packed": None}

    @property
    def is_prepacked(self) -> bool:
        """Whether forward takes the packed copy (it exists and is of the current weight)."""
        if self._cpu_packed is None:
            return False
        of, state = self._cpu_packed[1]
        return of() is self.weight and state == self._weight_state()

    def _weight_state(self) -> tuple:
        """What changes with the weight's values: its storage and in-place version (a `.data` swap
        such as `.half()`, or an optimizer step, each change one)."""
        w = self.weight
        return w.data_ptr(), w._version, w.dtype, w.device

    def prepack_cpu(self) -> bool:
        """Store the weight in oneDNN's packed layout too (see the module docstring); False where that
        does not apply: not a CPU weight of a dtype this CPU packs (`cpu_packing_available`)."""
        weight = self.weight
        if weight.device.type != "cpu" or not cpu_packing_available(weight.dtype):
            return False
        if not self.is_prepacked:
            with torch.no_grad():
                packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _CPU_PACK_ROWS_HINT)
            self._cpu_packed = (packed, (weakref.ref(weight), self._weight_state()))
        return True

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return y.split(self.out_features, dim=-1)

    @staticmethod
    def pack(weights: list[torch.Tensor], biases: list[torch.Tensor] | None, like: PackedLinear,
             device: torch.device) -> dict[str, torch.Tensor]:
        """HF [out_i, in] weights (and [out_i] biases) -> this module's parameters, cast like `like`."""
        dtype = like.weight.dtype
        packed = {"weight": torch.cat([w.to(device=device, dtype=dtype) for w in weights], 0)}
        if biases is not None:
            packed["bias"] = torch.cat(biases, 0).to(device=device, dtype=dtype)
        return packed


WIDEN_MIN_ROWS = 32
"""A bfloat16 CPU matmul where the CPU has no bf16 dot products (`_bf16_without_dot_products`) runs
on float32 copies of x and the weight from this many rows of x (oneDNN's float32 matmul), and in C
below it (`cpu_native.linear_bf16`: the weight widened in registers, no copy); both sum the exact
products in float32 and round to bf16 once, as torch's bf16 matmul does, which is the slowest of
the three there. C wins below this row count, the float32 copies from it (docs/results.md#cpu-decode)."""


def _bf16_without_dot_products(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (weight.dtype == torch.bfloat16 and x.device.type == "cpu" and x.dim() == 2 and x.shape[0] > 0
            and not torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and not cpu_packing_available(torch.bfloat16))


def prepack_cpu(module: nn.Module) -> int:
    """`PackedLinear.prepack_cpu` on every PackedLinear in `module`; how many were packed."""
    return sum(m.prepack_cpu() for m in module.modules() if isinstance(m, PackedLinear))


def packed_linear_at(root: nn.Module, name: str) -> PackedLinear:
    """`root`'s submodule `name`, which a checkpoint loader's packing table says is a PackedLinear."""
    module = root.get_submodule(name)
    assert isinstance(module, PackedLinear), (
        f"{name} is a {type(module).__name__}, not a PackedLinear: packing table out of step with the model?")
    return module


_cpu_packing: dict[torch.dtype, bool] = {}


def cpu_packing_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch has oneDNN's packed linear for `dtype` weights (float32; bfloat16 only on
    a CPU with native bf16 dot products) and it gives x @ w for row counts other than the one it was
    packed for (checked once per dtype, against a float64 matmul)."""
    if dtype not in _cpu_packing:
        _cpu_packing[dtype] = _probe_cpu_packing(dtype)
    return _cpu_packing[dtype]


def cpu_native_bf16() -> bool:
    """Whether torch multiplies bfloat16 natively on this CPU: oneDNN's bf16 dot products (AVX512-BF16
    or AMX) are there and not capped off (`ONEDNN_MAX_CPU_ISA=AVX2` makes such a CPU one without).
    The one test every bf16 CPU decision asks (packing, the C layer's share, training precision)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _probe_cpu_packing(dtype: torch.dtype) -> bool:
    mkldnn = torch.backends.mkldnn
    if not mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    if dtype == torch.bfloat16:
        if not cpu_native_bf16():
            return False
    elif dtype != torch.float32:
        return False
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 80, generator=gen).to(dtype)  # [out, in]
    try:
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, _CPU_PACK_ROWS_HINT)
            for rows in (1, 3, _CPU_PACK_ROWS_HINT, 37):
                x = torch.randn(rows, 80, generator=gen).to(dtype)
                got = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "").double()
                want = x.double() @ weight.double().t()
                if not torch.allclose(got, want, rtol=tol, atol=tol * want.abs().max().item()):
                    return False
    except (RuntimeError, NotImplementedError):
        return False
    return True
