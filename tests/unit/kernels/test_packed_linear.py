"""PackedLinear's oneDNN-packed CPU copy: the same products as the weight, never a stale one."""

from __future__ import annotations

import pytest
import torch

from kernels.model.packed_linear import PackedLinear, cpu_native_bf16, cpu_packing_available, prepack_cpu

pytestmark = pytest.mark.isa  # oneDNN packs bf16 only with bf16 dot products


def make_linear(bias: bool, seed: int = 0) -> PackedLinear:
    gen = torch.Generator().manual_seed(seed)
    linear = PackedLinear(48, (40, 24), bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(64, 48, generator=gen))
        if bias:
            linear.bias.copy_(torch.randn(64, generator=gen))
    return linear


def reference(linear: PackedLinear, x: torch.Tensor) -> torch.Tensor:
    out = x.double() @ linear.weight.detach().double().t()
    return out + linear.bias.detach().double() if linear.bias is not None else out


def test_this_torch_has_the_packed_gemm():
    """CI's x86 torch carries oneDNN: without the probe passing there, the path would silently be off."""
    assert cpu_packing_available() == torch.backends.mkldnn.is_available()


@pytest.mark.parametrize("bias", [False, True])
def test_packed_products_match_float64_for_every_row_count(bias):
    linear = make_linear(bias)
    assert linear.prepack_cpu() and linear.is_prepacked
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for rows in (1, 2, 3, 4, 7, 8, 9, 16, 33):
            x = torch.randn(rows, 48, generator=gen)
            torch.testing.assert_close(linear(x).double(), reference(linear, x), atol=1e-4, rtol=1e-4)
        wide = torch.randn(5, 96, generator=gen)[:, ::2]  # a non-contiguous input
        torch.testing.assert_close(linear(wide).double(), reference(linear, wide), atol=1e-4, rtol=1e-4)
        assert linear(torch.empty(0, 48)).shape == (0, 64)


def test_a_changed_weight_is_never_served_from_the_stale_copy():
    linear = make_linear(bias=True)
    x = torch.randn(4, 48, generator=torch.Generator().manual_seed(2))
    assert linear.prepack_cpu()
    with torch.no_grad():
        linear.weight.mul_(-2.0)  # in place, as an optimizer step
    assert not linear.is_prepacked
    with torch.inference_mode():
        torch.testing.assert_close(linear(x).double(), reference(linear, x), atol=1e-4, rtol=1e-4)
    assert linear.prepack_cpu()
    fresh = make_linear(bias=True, seed=5)
    linear.load_state_dict(fresh.state_dict(), assign=True)  # a replaced parameter
    assert not linear.is_prepacked
    with torch.inference_mode():
        torch.testing.assert_close(linear(x).double(), reference(fresh, x), atol=1e-4, rtol=1e-4)


def test_training_takes_the_differentiable_matmul():
    linear = make_linear(bias=False)
    assert linear.prepack_cpu()
    x = torch.randn(6, 48, requires_grad=True)
    linear(x).sum().backward()
    torch.testing.assert_close(x.grad, linear.weight.detach().sum(0).expand(6, 48))
    assert linear.weight.grad is not None


def test_prepack_applies_to_the_dtypes_this_cpu_packs():
    """float32 always; bfloat16 where the CPU has native bf16 dot products; float16 never."""
    bf16 = cpu_native_bf16()
    model = torch.nn.Sequential(make_linear(bias=False), make_linear(bias=True).to(torch.bfloat16),
                                make_linear(bias=True).to(torch.float16))
    assert prepack_cpu(model) == 1 + bf16
    assert model[0].is_prepacked and model[1].is_prepacked == bf16 and not model[2].is_prepacked


@pytest.mark.skipif(not cpu_native_bf16(), reason="needs bf16 dot products (AVX512-BF16 or AMX, not capped by "
                    "ONEDNN_MAX_CPU_ISA); this CPU has none: the bf16 path without them is tested below")
def test_bfloat16_packed_products_match_the_plain_matmul():
    linear = make_linear(bias=True).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(rows, 48, generator=gen).to(torch.bfloat16) for rows in (1, 5, 16, 40)]
    with torch.inference_mode():
        plain = [linear(x) for x in xs]
        assert linear.prepack_cpu() and linear.is_prepacked
        for x, want in zip(xs, plain):
            torch.testing.assert_close(linear(x), want, atol=0.05, rtol=0.02)


@pytest.mark.parametrize("bias", [False, True])
def test_bfloat16_without_packing_multiplies_in_float32_and_rounds_once(bias, monkeypatch):
    """Where oneDNN has no native bf16 (forced here), a bf16 matmul runs in C below `WIDEN_MIN_ROWS`
    rows and on float32 copies from there: either way the exact products summed and rounded to bf16
    once, as torch's bf16 matmul rounds, so at most a bf16 step from the float64 product rounded,
    and mostly equal to it; torch's bf16 matmul is never called."""
    from kernels.model import packed_linear

    monkeypatch.setitem(packed_linear._cpu_packing, torch.bfloat16, False)
    linear = make_linear(bias=bias).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(5)
    calls = []
    real_linear = packed_linear.F.linear
    monkeypatch.setattr(packed_linear.F, "linear", lambda *a: calls.append(a[0].dtype) or real_linear(*a))
    for rows in (1, 5, packed_linear.WIDEN_MIN_ROWS - 1, packed_linear.WIDEN_MIN_ROWS + 3):
        x = torch.randn(rows, 48, generator=gen).to(torch.bfloat16)
        with torch.inference_mode():
            got = linear(x)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 64)
        exact = reference(linear, x)
        step = exact.abs().clamp_min(1e-30).log2().floor().exp2() / 128
        assert ((got.double() - exact).abs() <= step).all()
        assert (got == exact.to(torch.bfloat16)).float().mean() >= 0.95
    assert calls == [torch.float32]  # the widest batch only
