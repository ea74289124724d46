"""The experts' compute of a mixture-of-experts layer (Mixtral, Qwen2-MoE, Qwen3-MoE): given each
token's routed experts and their weights, the weighted sum of those experts' gated MLPs.

The model routes (softmax, top-k, renormalisation); this module owns what follows::

    out[t] = sum_j  w[t, j] * down[e] @ (act(gate[e] @ x[t]) * (up[e] @ x[t])),   e = ids[t, j]
    gate[e] = gate_up[e, 0:I],  up[e] = gate_up[e, I:2I]       (transformers v5 layout)

`experts_forward` is the torch path (every device; the reference the Triton kernel is tested
against), `experts` dispatches a CUDA tensor to the fused Triton kernel (`kernels/cuda/fused_moe.py`)
and anything else to `experts_forward`. Numerics, shared by both: the two matmuls take their operands
in the model dtype; the activation, the routing weight and the sum over a token's k experts run in
float32; the gated product is rounded to the model dtype before the down matmul (as the model's own
MLP rounds it), and the sum to x's dtype at the end.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,  # Mixtral, Qwen2-MoE, Qwen3-MoE
    "gelu_pytorch_tanh": lambda g: F.gelu(g, approximate="tanh"),
}
"""The gate activations by their `hidden_act` name in a Hugging Face config."""


def activate(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate) * up`` in float32 (both ``[rows, I]``, any float dtype)."""
    assert activation in ACTIVATIONS, f"activation {activation!r} is not one of {sorted(ACTIVATIONS)}"
    return ACTIVATIONS[activation](gate.float()) * up.float()


def _check_args(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor, activation: str) -> tuple[int, int]:
    """Shape, dtype and device checks shared by both paths (none reads a device value); returns
    (num_experts, intermediate size I)."""
    assert x.dim() == 2, f"x has shape {tuple(x.shape)}, wanted [tokens, hidden]: flatten the batch first"
    assert gate_up.dim() == 3 and down.dim() == 3, (
        f"gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)} must be [E, 2I, H] and [E, H, I]: "
        "a single expert's weights passed?")
    num_experts, two_i, hidden = gate_up.shape
    inter = two_i // 2
    assert hidden == x.shape[1] and two_i % 2 == 0, (
        f"gate_up {tuple(gate_up.shape)} is not [E, 2I, H={x.shape[1]}]: the v4 per-expert layout, or transposed?")
    assert tuple(down.shape) == (num_experts, hidden, inter), (
        f"down {tuple(down.shape)} is not [E={num_experts}, H={hidden}, I={inter}]: transposed?")
    assert topk_ids.dim() == 2 and topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == x.shape[0], (
        f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must both be "
        f"[T={x.shape[0]}, k]")
    assert not topk_ids.is_floating_point() and not topk_ids.is_complex(), (
        f"topk_ids is {topk_ids.dtype}: ids and weights swapped?")
    assert topk_weights.dtype == torch.float32, f"topk_weights is {topk_weights.dtype}, wanted float32"
    assert gate_up.dtype == down.dtype == x.dtype, (
        f"x is {x.dtype}, gate_up {gate_up.dtype}, down {down.dtype}: cast the weights to the model dtype at load")
    devices = {t.device for t in (x, gate_up, down, topk_weights, topk_ids)}
    assert len(devices) == 1, f"tensors on several devices {sorted(map(str, devices))}"
    assert activation in ACTIVATIONS, f"activation {activation!r} is not one of {sorted(ACTIVATIONS)}"
    return num_experts, inter


def experts_forward(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """The experts' output ``[T, H]`` in x's dtype, in torch on x's device; nothing is mutated.

    x ``[T, H]``; gate_up ``[E, 2I, H]``; down ``[E, H, I]``; topk_weights ``[T, k]`` float32;
    topk_ids ``[T, k]`` integer in ``[0, E)``. T = 0 gives ``[0, H]``; an id repeated in a row
    counts once per slot. Reads the per-expert counts back to the host (one sync on a GPU).

    The T*k (token, slot) pairs, flattened as ``p = t * k + j``, are sorted by expert once::

        sorted position   | expert 0's pairs | expert 1's pairs | ... | expert E-1's pairs |
                          0                  c0                 c0+c1                     T*k
        order[i] = the pair at sorted position i (stable: by token within an expert)

    and each expert with pairs multiplies its tokens' rows in two matmuls.
    """
    num_experts, _ = _check_args(x, gate_up, down, topk_weights, topk_ids, activation)
    num_tokens, k = topk_ids.shape
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)  # [T, H]
    if num_tokens == 0:
        return out.to(x.dtype)
    flat_ids = topk_ids.reshape(-1).long()  # [T*k]
    lo, hi = int(flat_ids.min()), int(flat_ids.max())
    assert 0 <= lo and hi < num_experts, f"expert ids span [{lo}, {hi}], outside [0, {num_experts}): a router bug?"
    order = torch.argsort(flat_ids, stable=True)  # [T*k] pair ids, by expert
    tokens = order // k  # [T*k]
    weights = topk_weights.reshape(-1).index_select(0, order)  # [T*k] float32
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count:
            rows = tokens[start:start + count]
            # index_put_ rather than index_add_, whose multi-threaded CPU path (torch 2.13) outcosts
            # the matmuls here; both add twice where a row repeats
            out.index_put_((rows,), _one_expert(x.index_select(0, rows), gate_up[expert], down[expert],
                                                weights[start:start + count], activation), accumulate=True)
        start += count
    return out.to(x.dtype)


def _one_expert(x_rows: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                activation: str) -> torch.Tensor:
    """``w * down @ (act(gate @ x) * (up @ x))`` in float32 for the rows routed to one expert:
    x_rows ``[n, H]``, gate_up ``[2I, H]``, down ``[H, I]``, weights ``[n]`` float32 -> ``[n, H]``."""
    gate, up = F.linear(x_rows, gate_up).chunk(2, dim=-1)  # [n, I] each
    hidden = activate(gate, up, activation).to(x_rows.dtype)
    return F.linear(hidden, down).float() * weights[:, None]


def experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
            topk_ids: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """`experts_forward`'s contract; CUDA tensors run the fused Triton kernel (imported on first use,
    so a CPU process never imports Triton), others the torch path."""
    if x.is_cuda:
        from kernels.cuda.fused_moe import fused_experts

        return fused_experts(x, gate_up, down, topk_weights, topk_ids, activation)
    return experts_forward(x, gate_up, down, topk_weights, topk_ids, activation)
