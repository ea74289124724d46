"""The experts' compute of a mixture-of-experts layer, both paths, against a dense per-token loop.

`experts_forward` (torch) and `fused_experts` (Triton; without CUDA under the interpreter on CPU
tensors, which this directory's conftest turns on) are checked against `dense_reference`: for each
token, for each of its k slots, the plain gated MLP of that slot's expert in float64. Routings come
from `make_routing`, which leaves some experts unused and repeats an expert within a row; a
transformers MixtralExperts module checks the weight layout and the routing weights' meaning.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from kernels.cuda import fused_moe
from kernels.cuda.fused_moe import MoeTiles, align_to_blocks, default_tiles, fused_experts
from kernels.experts import ACTIVATIONS, activate, experts, experts_forward

TOLERANCES = {  # (atol, rtol) against the float64 reference; outputs are O(1)
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (1.6e-2, 1.6e-2),  # bf16 inputs, gated product and result: ~2 ulps at |o| ~ 2
}
SHAPES = [(T, E, k) for T in (0, 1, 7, 33) for E in (1, 4, 8) for k in (1, 2)]
HIDDEN, INTER = 32, 48


@dataclass
class Routing:
    """One MoE layer's input: hidden states, expert weights and the router's choice."""

    x: torch.Tensor  # [T, H]
    gate_up: torch.Tensor  # [E, 2I, H]
    down: torch.Tensor  # [E, H, I]
    weights: torch.Tensor  # [T, k] float32
    ids: torch.Tensor  # [T, k] int64

    def args(self) -> tuple[torch.Tensor, ...]:
        return self.x, self.gate_up, self.down, self.weights, self.ids


def make_routing(num_tokens: int, num_experts: int, top_k: int, dtype: torch.dtype = torch.float32, seed: int = 0,
                 device: str = "cpu", hidden: int = HIDDEN, inter: int = INTER) -> Routing:
    """Random weights scaled so every stage is O(1). Ids are drawn from the first ceil(E/2) + 1
    experts (with E >= 4 the last ones get nothing); with k >= 2, row 0 names one expert twice."""
    gen = torch.Generator().manual_seed(seed)
    used = min(num_experts, num_experts // 2 + 1)
    ids = torch.randint(0, used, (num_tokens, top_k), generator=gen)
    if num_tokens and top_k >= 2:
        ids[0, 1] = ids[0, 0]
    weights = torch.rand(num_tokens, top_k, generator=gen) + 0.1
    weights /= weights.sum(-1, keepdim=True).clamp(min=1e-6)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=device)

    return Routing(randn(num_tokens, hidden), randn(num_experts, 2 * inter, hidden, scale=hidden ** -0.5),
                   randn(num_experts, hidden, inter, scale=inter ** -0.5), weights.to(device), ids.to(device))


def dense_reference(r: Routing, activation: str = "silu") -> torch.Tensor:
    """``[T, H]`` float64: each token's k slots one at a time, each expert's gate, up and down apart."""
    x, gate_up, down = r.x.double().cpu(), r.gate_up.double().cpu(), r.down.double().cpu()
    inter = down.shape[2]
    act = {"silu": F.silu, "gelu_pytorch_tanh": lambda g: F.gelu(g, approximate="tanh")}[activation]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(r.ids.shape[1]):
            e = int(r.ids[t, j])
            gate, up = gate_up[e, :inter] @ x[t], gate_up[e, inter:] @ x[t]
            out[t] += float(r.weights[t, j]) * (down[e] @ (act(gate) * up))
    return out


def assert_matches_reference(out: torch.Tensor, r: Routing, activation: str = "silu") -> None:
    assert out.shape == r.x.shape and out.dtype == r.x.dtype and out.device == r.x.device
    atol, rtol = TOLERANCES[r.x.dtype]
    torch.testing.assert_close(out.cpu().double(), dense_reference(r, activation), atol=atol, rtol=rtol)


# ---- the torch path ----------------------------------------------------------------------------------

@pytest.mark.parametrize("num_tokens, num_experts, top_k", SHAPES)
def test_experts_forward_matches_the_dense_reference(num_tokens, num_experts, top_k):
    r = make_routing(num_tokens, num_experts, top_k, seed=num_tokens * 100 + num_experts * 10 + top_k)
    assert_matches_reference(experts_forward(*r.args()), r)


@pytest.mark.parametrize("num_tokens, num_experts, top_k", [(1, 1, 1), (7, 4, 2), (33, 8, 2)])
def test_experts_forward_in_bfloat16(num_tokens, num_experts, top_k):
    r = make_routing(num_tokens, num_experts, top_k, dtype=torch.bfloat16, seed=num_tokens)
    assert_matches_reference(experts_forward(*r.args()), r)


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_experts_forward_activations(activation):
    r = make_routing(7, 4, 2, seed=5)
    assert_matches_reference(experts_forward(*r.args(), activation=activation), r, activation)


def test_a_repeated_expert_counts_once_per_slot():
    r = make_routing(3, 4, 2, seed=1)
    r.ids[:] = torch.tensor([[2, 2], [0, 0], [3, 3]])
    single = Routing(r.x, r.gate_up, r.down, r.weights.sum(-1, keepdim=True), r.ids[:, :1])
    torch.testing.assert_close(experts_forward(*r.args()), experts_forward(*single.args()), atol=1e-6, rtol=1e-6)


def test_the_dispatcher_runs_cpu_tensors_on_the_torch_path():
    r = make_routing(7, 4, 2, seed=2)
    assert torch.equal(experts(*r.args()), experts_forward(*r.args()))


def test_activate_is_float32():
    gate = torch.tensor([[-1.0, 0.0, 2.0]], dtype=torch.bfloat16)
    got = activate(gate, torch.full_like(gate, 2.0), "silu")
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, 2 * F.silu(gate.float()))


@pytest.mark.parametrize("change, message", [
    (lambda r: {"x": r.x[None]}, "flatten the batch"),
    (lambda r: {"gate_up": r.gate_up.transpose(1, 2)}, "transposed"),
    (lambda r: {"down": r.down.transpose(1, 2)}, "transposed"),
    (lambda r: {"ids": r.ids[:, :1]}, "must both be"),
    (lambda r: {"ids": r.weights, "weights": r.ids.float()}, "swapped"),
    (lambda r: {"weights": r.weights.double()}, "wanted float32"),
    (lambda r: {"gate_up": r.gate_up.bfloat16(), "down": r.down.bfloat16()}, "cast the weights"),
    (lambda r: {"ids": r.ids + 4}, "outside [0, 4)"),
])
def test_bad_arguments_are_refused_naming_the_cause(change, message):
    r = make_routing(5, 4, 2)
    args = {"x": r.x, "gate_up": r.gate_up, "down": r.down, "weights": r.weights, "ids": r.ids, **change(r)}
    with pytest.raises(AssertionError, match=re.escape(message)):
        experts_forward(args["x"], args["gate_up"], args["down"], args["weights"], args["ids"])


def test_an_unknown_activation_is_refused_by_both_paths():
    r = make_routing(5, 4, 2, device=kernel_device())
    for path in (experts_forward, fused_experts):
        with pytest.raises(AssertionError, match="not one of"):
            path(*r.args(), activation="relu")


def test_transformers_mixtral_experts_agree():
    """A tiny Mixtral's experts module (transformers v5: gate_up_proj [E, 2I, H], down_proj [E, H, I])
    given the same ids and weights."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=64, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    module = MixtralForCausalLM(config).model.layers[0].mlp.experts
    r = make_routing(9, 4, 2, seed=3)
    with torch.no_grad():
        module.gate_up_proj.copy_(r.gate_up)
        module.down_proj.copy_(r.down)
        want = module(r.x, r.ids, r.weights)
    torch.testing.assert_close(experts_forward(r.x, module.gate_up_proj.detach(), module.down_proj.detach(),
                                               r.weights, r.ids), want, atol=1e-5, rtol=1e-5)


# ---- the Triton kernels ----------------------------------------------------------------------------

def kernel_device() -> str:
    """Where the kernels run: read at call time, since this directory's conftest may reload them."""
    return "cpu" if fused_moe.INTERPRETED else "cuda"


def test_align_to_blocks_pads_each_expert_to_whole_blocks():
    ids = torch.tensor([[3, 0], [0, 3], [1, 0], [0, 0], [3, 3], [0, 0], [0, 0], [0, 0], [0, 0], [0, 0]])
    got = align_to_blocks(ids, num_experts=4, block_m=16)
    zeros = [0] * 16
    pairs_of_0 = [1, 2, 5, 6, 7, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]  # p = t * 2 + j, in token order
    # max_blocks = cdiv(20 pairs, 16) + min(4 experts, 20) = 6
    assert got.sorted_pairs.tolist() == (pairs_of_0 + [0]) + ([4] + zeros[1:]) + ([0, 3, 8, 9] + zeros[4:]) + zeros * 3
    assert got.block_rows.tolist() == [15, 1, 4, 0, 0, 0]  # expert 2 has no block; then idle blocks
    assert got.block_expert.tolist()[:3] == [0, 1, 3] and got.block_rows.dtype == torch.int32


def test_align_to_blocks_splits_a_large_expert():
    ids = torch.zeros(40, 1, dtype=torch.int64)
    got = align_to_blocks(ids, num_experts=2, block_m=16)
    assert got.block_rows.tolist() == [16, 16, 8, 0, 0] and got.block_expert.tolist()[:3] == [0, 0, 0]
    assert got.sorted_pairs.tolist()[:40] == list(range(40))


def test_default_tiles_follow_the_rows_per_expert():
    assert default_tiles(2 * 8, 8, torch.bfloat16, interpreted=False).block_m == 16  # decode: 2 tokens, k=2
    assert default_tiles(2048 * 2, 8, torch.bfloat16, interpreted=False).block_m == 64
    assert default_tiles(2048 * 2, 8, torch.float32, interpreted=True) == MoeTiles(16, 16, 16)
    with pytest.raises(AssertionError, match="power of two"):
        MoeTiles(block_m=24, block_n=16, block_k=16)


@pytest.mark.usefixtures("triton_interpreted")
@pytest.mark.parametrize("num_tokens, num_experts, top_k", SHAPES)
def test_fused_experts_matches_the_dense_reference(num_tokens, num_experts, top_k):
    r = make_routing(num_tokens, num_experts, top_k, seed=num_tokens * 100 + num_experts * 10 + top_k,
                     device=kernel_device())
    assert_matches_reference(fused_experts(*r.args()), r)


@pytest.mark.usefixtures("triton_interpreted")
@pytest.mark.parametrize("num_tokens, num_experts, top_k", [(1, 1, 1), (7, 4, 2), (33, 8, 2)])
def test_fused_experts_in_bfloat16(num_tokens, num_experts, top_k):
    r = make_routing(num_tokens, num_experts, top_k, dtype=torch.bfloat16, seed=num_tokens, device=kernel_device())
    assert_matches_reference(fused_experts(*r.args()), r)


@pytest.mark.usefixtures("triton_interpreted")
def test_fused_experts_in_bfloat16_across_tiles():
    """bf16 weights, and sizes that are no multiple of the 16-wide tiles in H or I."""
    r = make_routing(19, 4, 2, dtype=torch.bfloat16, seed=7, device=kernel_device(), hidden=40, inter=24)
    assert_matches_reference(fused_experts(*r.args()), r)


@pytest.mark.usefixtures("triton_interpreted")
def test_fused_experts_gelu_and_strided_weights():
    r = make_routing(7, 4, 2, seed=8, device=kernel_device())
    r.down = r.down.transpose(1, 2).contiguous().transpose(1, 2)  # [E, H, I] with stride(2) != 1
    assert_matches_reference(fused_experts(*r.args(), activation="gelu_pytorch_tanh"), r, "gelu_pytorch_tanh")


@pytest.mark.usefixtures("triton_interpreted")
def test_fused_experts_at_prefill_tiles():
    """The compiled prefill tiles (64-row blocks) run under the interpreter too."""
    r = make_routing(40, 4, 2, seed=9, device=kernel_device())
    tiles = default_tiles(4096, 4, torch.float32, interpreted=False)
    assert tiles.block_m == 64
    assert_matches_reference(fused_experts(*r.args(), tiles=tiles), r)
