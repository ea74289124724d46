"""The fused experts of a mixture-of-experts layer in Triton: `fused_experts`, with the contract of
`kernels.experts.experts_forward` (the torch path it is tested against).

The T*k (token, slot) pairs, ``p = t * k + j``, are sorted by expert and each expert's run is padded
to a whole number of BLOCK_M-row blocks (`align_to_blocks`), so every block holds one expert's rows::

    blocks   | expert a's c_a pairs, padding | expert b's c_b pairs, padding | ... | idle blocks |
             0                        ceil(c_a / M)                         used        max_blocks
    max_blocks = cdiv(T*k, M) + min(E, T*k)
    block_rows[b]           pairs in block b: M, fewer in an expert's last block, 0 in an idle block
    sorted_pairs[b * M + r] the pair of row r of block b, for r < block_rows[b] (past it: 0, never read)

Experts without pairs get no block. ``max_blocks`` bounds the used blocks from shapes alone
(sum_e ceil(c_e / M) <= T*k / M + experts used), so nothing is read back to the host: the grid is
max_blocks tall and an idle block's programs return at once.

Two kernels then run over (block, column tile) grids:

    1. gate_up: hidden[p, n] = act(gate[e] @ x[t])[n] * (up[e] @ x[t])[n]      hidden [T*k, I], model dtype
    2. down:    out[p, n]    = w[p] * (down[e] @ hidden[p])[n]                  out    [T*k, H], float32

and torch sums out over the k slots of each token. Both matmuls accumulate in fp32 from operands in
``DOT_DTYPE``: the model dtype when compiled, fp32 (``ieee``) for fp32 models and under
``TRITON_INTERPRET=1`` (whose numpy matmul would multiply bf16 bit patterns as integers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

INTERPRETED: bool = bool(triton.knobs.runtime.interpret)
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
SMALL_BLOCK_ROWS = 16
"""Pairs per expert up to which BLOCK_M is 16 (decode: a few tokens per expert), else 64."""


@triton.jit
def _block_pairs(block, rows, sorted_pairs_ptr, block_expert_ptr, BLOCK_M: tl.constexpr):
    """Block `block`'s expert, which of its BLOCK_M rows hold a pair, and those pairs' ids."""
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    m = tl.arange(0, BLOCK_M)
    row_ok = m < rows
    pair = tl.load(sorted_pairs_ptr + block * BLOCK_M + m, mask=row_ok, other=0)  # [BLOCK_M]
    return expert, row_ok, pair


@triton.jit
def gate_up_kernel(
    x_ptr, gate_up_ptr, hidden_ptr, sorted_pairs_ptr, block_expert_ptr, block_rows_ptr,
    hidden_size, inter_size, top_k,
    stride_x_t, stride_gu_e, stride_gu_n, stride_gu_k, stride_h_p,
    ACTIVATION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """Program (b, c): the rows of block b, columns ``[c * BLOCK_N, (c + 1) * BLOCK_N)`` of I; the
    gate tile is rows ``n`` of ``gate_up[e]``, the up tile rows ``I + n``."""
    block = tl.program_id(0)
    rows = tl.load(block_rows_ptr + block)
    if rows == 0:
        return
    expert, row_ok, pair = _block_pairs(block, rows, sorted_pairs_ptr, block_expert_ptr, BLOCK_M)
    token = pair // top_k
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < inter_size
    kk = tl.arange(0, BLOCK_K)
    # tile pointers advance by BLOCK_K columns a step, rather than being rebuilt from 64-bit offsets
    x_tile = x_ptr + token[:, None] * stride_x_t + kk[None, :]  # [BLOCK_M, BLOCK_K]
    gate_tile = gate_up_ptr + expert * stride_gu_e + kk[:, None] * stride_gu_k + n[None, :] * stride_gu_n
    up_offset = inter_size * stride_gu_n  # [BLOCK_K, BLOCK_N] above: gate rows n transposed; up rows are I + n
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden_size, BLOCK_K):
        k_ok = kk < hidden_size - k0
        x = tl.load(x_tile, mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(DOT_DTYPE)
        w_ok = k_ok[:, None] & n_ok[None, :]
        w_gate = tl.load(gate_tile, mask=w_ok, other=0.0).to(DOT_DTYPE)
        acc_gate += tl.dot(x, w_gate, input_precision="ieee")
        w_up = tl.load(gate_tile + up_offset, mask=w_ok, other=0.0).to(DOT_DTYPE)
        acc_up += tl.dot(x, w_up, input_precision="ieee")
        x_tile += BLOCK_K
        gate_tile += BLOCK_K * stride_gu_k
    if ACTIVATION == "silu":
        act = acc_gate * tl.sigmoid(acc_gate)
    else:  # gelu_pytorch_tanh: 0.5 g (1 + tanh(u)), with 1 + tanh(u) = 2 sigmoid(2u)
        inner = 0.7978845608028654 * (acc_gate + 0.044715 * acc_gate * acc_gate * acc_gate)
        act = acc_gate * tl.sigmoid(2.0 * inner)
    out = act * acc_up
    tl.store(hidden_ptr + pair[:, None] * stride_h_p + n[None, :], out.to(hidden_ptr.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def down_kernel(
    hidden_ptr, down_ptr, out_ptr, weights_ptr, sorted_pairs_ptr, block_expert_ptr, block_rows_ptr,
    hidden_size, inter_size,
    stride_h_p, stride_d_e, stride_d_n, stride_d_k, stride_o_p,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    """Program (b, c): the rows of block b, columns ``[c * BLOCK_N, (c + 1) * BLOCK_N)`` of H, each
    row scaled by its pair's routing weight and stored in fp32 at its pair's row of ``out``."""
    block = tl.program_id(0)
    rows = tl.load(block_rows_ptr + block)
    if rows == 0:
        return
    expert, row_ok, pair = _block_pairs(block, rows, sorted_pairs_ptr, block_expert_ptr, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < hidden_size
    kk = tl.arange(0, BLOCK_K)
    h_tile = hidden_ptr + pair[:, None] * stride_h_p + kk[None, :]  # [BLOCK_M, BLOCK_K]
    w_tile = down_ptr + expert * stride_d_e + kk[:, None] * stride_d_k + n[None, :] * stride_d_n  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter_size, BLOCK_K):
        k_ok = kk < inter_size - k0
        h = tl.load(h_tile, mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(DOT_DTYPE)
        w = tl.load(w_tile, mask=k_ok[:, None] & n_ok[None, :], other=0.0).to(DOT_DTYPE)
        acc += tl.dot(h, w, input_precision="ieee")
        h_tile += BLOCK_K
        w_tile += BLOCK_K * stride_d_k
    weight = tl.load(weights_ptr + pair, mask=row_ok, other=0.0)  # [BLOCK_M] fp32
    acc = acc * weight[:, None]
    tl.store(out_ptr + pair[:, None] * stride_o_p + n[None, :], acc, mask=row_ok[:, None] & n_ok[None, :])


@dataclass(frozen=True)
class MoeTiles:
    """Tile sizes of both kernels; each a power of two >= 16 (tl.dot's minimum)."""

    block_m: int  # sorted pairs per program (one expert's)
    block_n: int  # output columns per program: of I in gate_up, of H in down
    block_k: int  # reduction step: of H in gate_up, of I in down
    num_warps: int = 4

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            assert value >= 16 and value & (value - 1) == 0, f"{name}={value} must be a power of two >= 16"


def default_tiles(num_pairs: int, num_experts: int, dtype: torch.dtype, interpreted: bool | None = None) -> MoeTiles:
    """Tiles for T*k pairs over E experts: 16-row blocks when an expert gets few pairs (decode), so
    padding wastes little, 64 otherwise; picked so no sm_80 or sm_90 build spills a register
    (tests/unit/kernels/test_fused_moe_aot.py). fp32 (``ieee``) matmuls run on FMA units out of
    registers, hence the narrower decode tile. Under the interpreter (``None``: as the kernels were
    built) 16 everywhere, so small test shapes still cross tile boundaries."""
    if INTERPRETED if interpreted is None else interpreted:
        return MoeTiles(block_m=16, block_n=16, block_k=16)
    if num_pairs <= SMALL_BLOCK_ROWS * num_experts:
        if dtype == torch.float32:
            return MoeTiles(block_m=16, block_n=32, block_k=32, num_warps=4)
        return MoeTiles(block_m=16, block_n=64, block_k=32, num_warps=4)
    return MoeTiles(block_m=64, block_n=64, block_k=32, num_warps=8)


@dataclass(frozen=True)
class SortedPairs:
    """The pairs sorted by expert in blocks of ``block_m`` rows (the module docstring's table)."""

    sorted_pairs: torch.Tensor  # [max_blocks * block_m] int64 pair ids p = t * k + j
    block_expert: torch.Tensor  # [max_blocks] int64 expert of each block (an idle block: any expert)
    block_rows: torch.Tensor  # [max_blocks] int32 pairs in each block, 0 for an idle block
    block_m: int


def align_to_blocks(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> SortedPairs:
    """Sorts the pairs of ``topk_ids`` ``[T, k]`` by expert, each expert padded to whole blocks, on
    the ids' device without reading anything back (`_no_sync`: sizes come from shapes). Ids must lie
    in ``[0, E)``; one outside is a device-side indexing error."""
    flat_ids = topk_ids.reshape(-1).long()  # [P = T*k]
    num_pairs = flat_ids.numel()
    device = flat_ids.device
    max_blocks = triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))  # [E] pairs per expert
    blocks = (counts + block_m - 1) // block_m  # [E]
    blocks_end = torch.cumsum(blocks, 0)  # [E] expert e owns blocks [blocks_end[e] - blocks[e], blocks_end[e])
    blocks_start = blocks_end - blocks
    pairs_start = torch.cumsum(counts, 0) - counts  # [E] e's first position in the unpadded sort

    order = torch.argsort(flat_ids, stable=True)  # [P] pair ids by expert, by token within one
    sorted_ids = flat_ids.index_select(0, order)
    rank = torch.arange(num_pairs, device=device) - pairs_start.index_select(0, sorted_ids)  # within its expert
    dest = blocks_start.index_select(0, sorted_ids) * block_m + rank
    sorted_pairs = torch.zeros(max_blocks * block_m, dtype=torch.int64, device=device)
    sorted_pairs.index_copy_(0, dest, order)

    block = torch.arange(max_blocks, device=device)
    block_expert = torch.searchsorted(blocks_end, block, right=True).clamp_(max=num_experts - 1)
    # past the used blocks the clamped expert's own blocks are behind, so the row count comes out <= 0
    rows = counts.index_select(0, block_expert) - (block - blocks_start.index_select(0, block_expert)) * block_m
    return SortedPairs(sorted_pairs, block_expert, rows.clamp_(0, block_m).to(torch.int32), block_m)


def _check_args(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, activation: str) -> tuple[int, int, int]:
    """(E, I, H) after the checks the kernels rely on (`kernels.experts._check_args` has the
    full set; importing it would close an import circle with the dispatcher there)."""
    assert x.dim() == 2 and gate_up.dim() == 3 and down.dim() == 3, (
        f"x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)}: "
        "want [T, H], [E, 2I, H], [E, H, I]")
    num_experts, two_i, hidden_size = gate_up.shape
    assert hidden_size == x.shape[1] and tuple(down.shape) == (num_experts, hidden_size, two_i // 2), (
        f"x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)}: a transposed weight?")
    assert topk_ids.dim() == 2 and topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == x.shape[0], (
        f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must be [T={x.shape[0]}, k]")
    assert topk_weights.dtype == torch.float32 and not topk_ids.is_floating_point(), (
        f"topk_weights {topk_weights.dtype} (want float32), topk_ids {topk_ids.dtype} (want int): swapped?")
    assert gate_up.dtype == down.dtype == x.dtype, f"x {x.dtype}, gate_up {gate_up.dtype}, down {down.dtype} differ"
    assert activation in ACTIVATIONS, f"activation {activation!r} is not one of {ACTIVATIONS}"
    return num_experts, two_i // 2, hidden_size


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, activation: str = "silu", tiles: MoeTiles | None = None) -> torch.Tensor:
    """`kernels.experts.experts_forward`'s contract on a CUDA device (CPU tensors under the
    interpreter); reads nothing back to the host. ``tiles``: `default_tiles` when None."""
    num_experts, inter, hidden_size = _check_args(x, gate_up, down, topk_weights, topk_ids, activation)
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 0:
        return x.new_zeros(0, hidden_size)
    num_pairs = num_tokens * top_k
    tiles = tiles or default_tiles(num_pairs, num_experts, x.dtype)
    aligned = align_to_blocks(topk_ids, num_experts, tiles.block_m)
    num_blocks = aligned.block_rows.numel()
    x = x if x.stride(1) == 1 else x.contiguous()
    dot = tl.float32 if INTERPRETED or x.dtype == torch.float32 else {
        torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[x.dtype]

    hidden = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)  # [T*k, I]
    gate_up_kernel[(num_blocks, triton.cdiv(inter, tiles.block_n))](
        x, gate_up, hidden, aligned.sorted_pairs, aligned.block_expert, aligned.block_rows,
        hidden_size, inter, top_k,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), gate_up.stride(2), hidden.stride(0),
        ACTIVATION=activation, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        DOT_DTYPE=dot, num_warps=tiles.num_warps,
    )
    out = torch.empty(num_pairs, hidden_size, dtype=torch.float32, device=x.device)  # [T*k, H]
    down_kernel[(num_blocks, triton.cdiv(hidden_size, tiles.block_n))](
        hidden, down, out, topk_weights.reshape(-1).contiguous(), aligned.sorted_pairs, aligned.block_expert,
        aligned.block_rows, hidden_size, inter,
        hidden.stride(0), down.stride(0), down.stride(1), down.stride(2), out.stride(0),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, DOT_DTYPE=dot,
        num_warps=tiles.num_warps,
    )
    return out.view(num_tokens, top_k, hidden_size).sum(1).to(x.dtype)
