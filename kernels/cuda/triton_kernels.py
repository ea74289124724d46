"""Triton kernels over tandem's paged KV: write_kv, paged decode (split-K) and paged extend.

Caches are ``[num_pages, page_size, kvh, hd]`` with the last axis contiguous; KV position ``j``
of sequence ``b`` lives in page ``page_table[b, j // page_size]`` at slot ``j % page_size``::

    positions   | cached prefix (earlier steps)      | new this step (q_len rows)  |
                0                        prefix = s - q_len                     s = seq_len
    query row i (0 <= i < q_len) is at position prefix + i and attends [0, prefix + i]

Every kernel reads lengths from device tensors, so a launch grid sized from host copies is only
ever an upper bound: a grid that is too large idles, never reads a wrong position. That is what
lets a captured decode graph replay with longer sequences than it was captured with.

Sliding window (``HAS_WINDOW``): row at ``pos`` sees only ``(pos - window, pos]``. Each program starts
its KV loop at the first position its earliest row can see, so pages wholly behind the window are never
loaded; only the rows of an extend block that sit later than its first need a per-position mask.

Soft cap (``HAS_SOFTCAP``): a score ``x`` (after the softmax scale) becomes ``c * tanh(x / c)``. Triton's
interpreter has no libdevice, so tanh is written out with exp2, accurate to ~2e-7 absolute: with
``y = 2 log2(e) x / c`` (what ``qk_scale`` makes of q.k), ``tanh(x / c) = 1 - 2 / (1 + 2^y)``, and the
log2-domain score is that times ``softcap_log2 = c log2(e)``. Without it ``qk_scale`` is
``scale log2(e)``. Both flags are constexpr: a kernel without them is the one it was before.

Numerics: softmax runs in the log2 domain in fp32; P is rounded to V's dtype before P @ V, as
flash attention does on tensor cores. Both matmuls take their operands in ``DOT_DTYPE`` and
accumulate in fp32: the cache dtype when compiled, fp32 for fp32 caches (``ieee``, never tf32) and
under ``TRITON_INTERPRET=1``, whose numpy matmul would multiply bf16 bit patterns as uint16
(silently wrong). A bf16 x bf16 product is exact in fp32, so both agree up to summation order.

The page lookup and the matmul are written out in each kernel rather than as ``@triton.jit``
helpers: the interpreter re-patches ``triton.language`` on every nested jit call, which was a
large share of the interpreted test time (docs/results.md#tooling).

Whether these run compiled or interpreted is fixed by ``TRITON_INTERPRET`` as triton and this
module are first imported (``triton.jit`` reads it then); ``INTERPRETED`` records which. The
``ieee`` matmul precision matters for fp32 operands only; 16-bit ones run on tensor cores.
"""

from __future__ import annotations

import triton
import triton.language as tl

INTERPRETED: bool = bool(triton.knobs.runtime.interpret)
LOG2E = 1.4426950408889634
NO_SCORE_YET = tl.constexpr(-1.0e30)
"""A windowed extend row's running max before it has seen a position: below any log2 score, yet finite."""


@triton.jit
def write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, num_tokens,
    stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_c_page, stride_c_slot, stride_c_head,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_KVH: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Program p copies the K and V [kvh, hd] of tokens ``[p * BLOCK_T, (p + 1) * BLOCK_T)`` to
    their flat slots ``slot_mapping[t]``; a tile row is one token's (head, dim) pairs."""
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    t_ok = t < num_tokens
    slot = tl.load(slot_mapping_ptr + t, mask=t_ok, other=0)
    dst = (slot // PAGE_SIZE) * stride_c_page + (slot % PAGE_SIZE) * stride_c_slot
    e = tl.arange(0, BLOCK_KVH * BLOCK_D)  # (head, dim) pairs, padded
    h = e // BLOCK_D
    d = e % BLOCK_D
    ok = t_ok[:, None] & ((h < NUM_KV_HEADS) & (d < HEAD_DIM))[None, :]
    cache_off = dst[:, None] + (h * stride_c_head + d)[None, :]
    k = tl.load(k_ptr + t[:, None] * stride_k_t + (h * stride_k_h + d)[None, :], mask=ok)
    tl.store(k_cache_ptr + cache_off, k.to(k_cache_ptr.dtype.element_ty), mask=ok)
    v = tl.load(v_ptr + t[:, None] * stride_v_t + (h * stride_v_h + d)[None, :], mask=ok)
    tl.store(v_cache_ptr + cache_off, v.to(v_cache_ptr.dtype.element_ty), mask=ok)


@triton.jit
def decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, page_table_ptr, seq_lens_ptr, mid_o_ptr, mid_lse_ptr,
    qk_scale, softcap_log2, window, num_splits,
    stride_q_t, stride_q_h,
    stride_c_page, stride_c_slot, stride_c_head,
    stride_pt_b,
    stride_mo_b, stride_mo_h, stride_mo_s, stride_ml_b, stride_ml_h,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):
    """Stage 1 of decode, program (b, kv head g, split s): the GROUP query heads of g, row b of q,
    over split s's KV range; writes the normalised partial output and its log2-sum-exp.

    The visible range is ``[lo, seq_len)``: lo = 0, or ``max(seq_len - window, 0)`` with a window (the
    query sits at seq_len - 1). Split s covers ``[lo + s * split_len, min(lo + (s + 1) * split_len, seq_len))``
    with split_len = ceil((seq_len - lo) / num_splits) rounded up to BLOCK_N, so every position a split
    loads is visible; split 0 is never empty (seq_len >= 1), a later one may be and then writes
    lse = -inf. Query heads are padded to BLOCK_H (>= 16, what tl.dot needs); padded rows read zeros
    and are never stored.
    """
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    head_in_group = tl.arange(0, BLOCK_H)
    head_ok = head_in_group < GROUP
    heads = kv_head * GROUP + head_in_group  # [BLOCK_H]
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM

    seq_len = tl.load(seq_lens_ptr + b)
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    else:
        lo = 0
    split_len = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    q_off = b * stride_q_t + heads[:, None] * stride_q_h + d[None, :]
    q = tl.load(q_ptr + q_off, mask=head_ok[:, None] & d_ok[None, :], other=0.0).to(DOT_DTYPE)  # [BLOCK_H, BLOCK_D]
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        kv_pos = n0 + tl.arange(0, BLOCK_N)
        kv_ok = kv_pos < end
        page = tl.load(page_table_ptr + b * stride_pt_b + kv_pos // PAGE_SIZE, mask=kv_ok, other=0)  # masked: page 0
        kv_off = page * stride_c_page + (kv_pos % PAGE_SIZE) * stride_c_slot + kv_head * stride_c_head
        kv_off = kv_off[:, None] + d[None, :]  # [BLOCK_N, BLOCK_D]
        kv_mask = kv_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision="ieee") * qk_scale  # [BLOCK_H, BLOCK_N]
        if HAS_SOFTCAP:
            s = (1.0 - 2.0 / (1.0 + tl.exp2(s))) * softcap_log2  # tanh; 2^s = inf gives 1, 0 gives -1
        s = tl.where(kv_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: the block holds a valid position
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        p = p.to(v.dtype).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p, v.to(DOT_DTYPE), input_precision="ieee")
        m_i = m_new

    nonempty = l_i > 0.0
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    o = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    mo_off = b * stride_mo_b + heads[:, None] * stride_mo_h + split * stride_mo_s + d[None, :]
    tl.store(mid_o_ptr + mo_off, o, mask=head_ok[:, None] & d_ok[None, :])
    tl.store(mid_lse_ptr + b * stride_ml_b + heads * stride_ml_h + split, lse, mask=head_ok)


@triton.jit
def decode_combine_kernel(
    mid_o_ptr, mid_lse_ptr, out_ptr, num_splits,
    stride_mo_b, stride_mo_h, stride_mo_s, stride_ml_b, stride_ml_h, stride_o_t, stride_o_h,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Stage 2 of decode, program (b, h): merges the splits' partial outputs by their lse."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < num_splits
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    lse = tl.load(mid_lse_ptr + b * stride_ml_b + h * stride_ml_h + s, mask=s_ok, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, 0))  # [BLOCK_S]; 0 for empty splits, split 0 is finite
    mo_off = b * stride_mo_b + h * stride_mo_h + s[:, None] * stride_mo_s + d[None, :]
    o = tl.load(mid_o_ptr + mo_off, mask=s_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_S, BLOCK_D]
    out = tl.sum(o * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(out_ptr + b * stride_o_t + h * stride_o_h + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


@triton.jit
def extend_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, page_table_ptr, query_start_loc_ptr, seq_lens_ptr,
    tree_mask_ptr, tree_start_ptr, tree_width_ptr,
    qk_scale, softcap_log2, window,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h,
    stride_c_page, stride_c_slot, stride_c_head,
    stride_pt_b,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr,
    HAS_TREE: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):
    """Program (m, b, h): query rows ``[m * BLOCK_M, (m + 1) * BLOCK_M)`` of sequence b, head h,
    causal over ``[0, own position]`` (flash attention, online softmax). With ``HAS_TREE``, a
    sequence of window width w > 0 (metadata.TreeMask) sees inside its last w positions only what
    its mask rows (``tree_mask[start + i * w + j]``) name. With ``HAS_WINDOW`` (never with a tree:
    the backend refuses that) row i sees ``(pos_i - window, pos_i]``, and the loop starts at the first
    row's lower bound.

    A program past its sequence's q_len runs no KV block and stores nothing. Without a window every
    row of a live block (padding rows too) sees position 0, so no row's running max stays -inf; with
    one a row may see nothing of a block, so its running max starts at the finite ``NO_SCORE_YET``
    (exp2 of -inf minus it is 0, of it minus itself 1: its sums stay 0 until it sees a position).
    """
    m_block = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2)
    kv_head = h // GROUP
    q_start = tl.load(query_start_loc_ptr + b)
    q_len = tl.load(query_start_loc_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    prefix = seq_len - q_len
    if HAS_TREE:
        tree_start = tl.load(tree_start_ptr + b)
        tree_width = tl.load(tree_width_ptr + b)

    i = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows within the sequence
    row_ok = i < q_len
    pos = prefix + i
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_off = (q_start + i)[:, None] * stride_q_t + h * stride_q_h + d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(DOT_DTYPE)  # [BLOCK_M, BLOCK_D]

    # The block's last row sits at prefix + (m + 1) * BLOCK_M - 1; nothing past it is visible.
    kv_end = tl.minimum(seq_len, prefix + (m_block + 1) * BLOCK_M)
    kv_end = tl.where(m_block * BLOCK_M < q_len, kv_end, 0)
    if HAS_WINDOW:
        kv_start = tl.maximum(prefix + m_block * BLOCK_M - window + 1, 0)  # the block's first row's window
        m_i = tl.full([BLOCK_M], NO_SCORE_YET, tl.float32)
        # row i sees kv_rel in (row_lo, row_hi], offsets from kv_start: int32 tiles spill less than int64 on sm_80
        row_lo = (pos - window - kv_start).to(tl.int32)
        row_hi = (pos - kv_start).to(tl.int32)
    else:
        kv_start = 0
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(kv_start, kv_end, BLOCK_N):
        kv_pos = n0 + tl.arange(0, BLOCK_N)
        kv_ok = kv_pos < kv_end
        page = tl.load(page_table_ptr + b * stride_pt_b + kv_pos // PAGE_SIZE, mask=kv_ok, other=0)  # masked: page 0
        kv_off = page * stride_c_page + (kv_pos % PAGE_SIZE) * stride_c_slot + kv_head * stride_c_head
        kv_off = kv_off[:, None] + d[None, :]  # [BLOCK_N, BLOCK_D]
        kv_mask = kv_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision="ieee") * qk_scale  # [BLOCK_M, BLOCK_N]
        if HAS_SOFTCAP:
            s = (1.0 - 2.0 / (1.0 + tl.exp2(s))) * softcap_log2  # tanh; 2^s = inf gives 1, 0 gives -1
        if HAS_WINDOW:
            kv_rel = (kv_pos - kv_start).to(tl.int32)
            visible = kv_ok[None, :] & (kv_rel[None, :] > row_lo[:, None]) & (kv_rel[None, :] <= row_hi[:, None])
        else:
            visible = kv_ok[None, :] & (kv_pos[None, :] <= pos[:, None])
        if HAS_TREE:
            tree_lo = seq_len - tree_width
            in_window = kv_pos[None, :] >= tree_lo
            mask_off = tree_start + i[:, None] * tree_width + (kv_pos[None, :] - tree_lo)
            seen = tl.load(tree_mask_ptr + mask_off, mask=visible & in_window & row_ok[:, None], other=0)
            visible = visible & ((~in_window) | (seen != 0))
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        p = p.to(v.dtype).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p, v.to(DOT_DTYPE), input_precision="ieee")
        m_i = m_new

    out = acc / tl.where(row_ok, l_i, 1.0)[:, None]
    o_off = (q_start + i)[:, None] * stride_o_t + h * stride_o_h + d[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
