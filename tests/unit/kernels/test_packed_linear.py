"""PackedLinear's MKL-packed CPU copy: the same products as the weight, never a stale one."""

from __future__ import annotations

import pytest
import torch

from kernels.model.packed_linear import PackedLinear, cpu_packing_available, prepack_cpu


def make_linear(bias: bool, seed: int = 0) -> PackedLinear:
    gen = torch.Generator().manual_seed(seed)
    linear = PackedLinear(48, (40, 24), bias=bias)
    with torch.no_grad():
        linear.weight_t.copy_(torch.randn(48, 64, generator=gen))
        if bias:
            linear.bias.copy_(torch.randn(64, generator=gen))
    return linear


def reference(linear: PackedLinear, x: torch.Tensor) -> torch.Tensor:
    out = x.double() @ linear.weight_t.detach().double()
    return out + linear.bias.detach().double() if linear.bias is not None else out


def test_this_torch_has_the_packed_gemm():
    """CI's x86 torch carries MKL: without the probe passing there, the path would silently be off."""
    assert cpu_packing_available() == torch.backends.mkl.is_available()


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


def test_a_changed_weight_is_never_served_from_the_stale_copy():
    linear = make_linear(bias=True)
    x = torch.randn(4, 48, generator=torch.Generator().manual_seed(2))
    assert linear.prepack_cpu()
    with torch.no_grad():
        linear.weight_t.mul_(-2.0)  # in place, as an optimizer step
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
    torch.testing.assert_close(x.grad, linear.weight_t.detach().sum(1).expand(6, 48))
    assert linear.weight_t.grad is not None


def test_prepack_applies_to_float32_cpu_weights_only():
    model = torch.nn.Sequential(make_linear(bias=False), make_linear(bias=True).to(torch.bfloat16))
    assert prepack_cpu(model) == 1
    assert model[0].is_prepacked and not model[1].is_prepacked
