"""Triton attention with a sliding window and a soft cap, against a dense float64 reference written here.

The reference gathers each sequence's K/V position by position through its page table, builds the full
``[H, q, seq_len]`` score matrix, soft-caps it, masks it (causal, and ``(pos - window, pos]``: what
transformers masks) and takes the softmax. The Triton caches are poisoned with NaN (`poisoned`) outside
the live prefix, as in `test_triton_parity`, and also at every position that no new row of its sequence
can see (behind the first row's window): the kernels must skip those pages, not load and mask them (a
NaN V times a zero weight is still NaN).

Under the interpreter (no CUDA) the tiles are 16 positions, so the windows below (1, 4, 16, 20, 100)
fall inside one page of 16, on a page edge, across pages and past the whole sequence.
"""

from __future__ import annotations

import pytest
import torch

from kernels.cuda.triton_backend import TileSizes, TritonAttentionBackend
from tests.unit.kernels.test_tree_attention import tree_step
from tests.unit.kernels.test_triton_parity import TOLERANCES, Case, kernel_device, make_case, poisoned

pytestmark = pytest.mark.usefixtures("triton_interpreted")

RULES = pytest.mark.parametrize("window,softcap", [(20, None), (None, 1.5), (4, 3.0)],
                                ids=["window", "softcap", "both"])
GQA = pytest.mark.parametrize("heads,kv_heads", [(2, 2), (3, 1)], ids=["gqa1", "gqa3"])
PAGE_SIZES = pytest.mark.parametrize("page_size", [1, 16])


def window_masks(meta, window: int | None) -> list[torch.Tensor]:
    """Per sequence, ``[q, seq_len]`` bool: row i (at position s - q + i) sees j iff pos - window < j <= pos."""
    masks = []
    for q_len, s_len in zip(meta.query_lens_cpu, meta.seq_lens_cpu):
        rows, cols = torch.arange(s_len - q_len, s_len)[:, None], torch.arange(s_len)[None, :]
        seen = cols <= rows
        masks.append(seen if window is None else seen & (cols > rows - window))
    return masks


def dense_reference(meta, k_cache: torch.Tensor, v_cache: torch.Tensor, q: torch.Tensor, masks: list[torch.Tensor],
                    scale: float, softcap: float | None) -> torch.Tensor:
    """[T, H, hd] float64 over caches that already hold the step's K/V, seq b's rows under ``masks[b]``."""
    page_size, kv_heads, head_dim = k_cache.shape[1:]
    heads, qsl, outs = q.shape[1], meta.query_start_loc_cpu, []
    for b, s_len in enumerate(meta.seq_lens_cpu):
        pos = torch.arange(s_len)
        slots = meta.page_table[b].cpu()[pos // page_size] * page_size + pos % page_size  # [s]
        k, v = (c.cpu().reshape(-1, kv_heads, head_dim)[slots].double().repeat_interleave(heads // kv_heads, 1)
                for c in (k_cache, v_cache))  # [s, H, hd]
        scores = torch.einsum("qhd,shd->hqs", q[qsl[b]:qsl[b + 1]].cpu().double(), k) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        weights = scores.masked_fill(~masks[b], float("-inf")).softmax(-1)
        outs.append(torch.einsum("hqs,shd->qhd", weights, v))
    return torch.cat(outs) if outs else q.new_zeros(0, *q.shape[1:]).double()


def behind_every_window(case: Case, window: int | None) -> torch.Tensor:
    """[num_slots] bool: slots of positions no new row of their sequence sees (before prefix - window + 1)."""
    hidden = torch.zeros(case.live.shape, dtype=torch.bool)
    page_size, meta = case.k_cache.shape[1], case.meta
    for b, (q_len, s_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        pos = torch.arange(0 if window is None else max(0, s_len - q_len - window + 1))
        hidden[meta.page_table[b].cpu()[pos // page_size] * page_size + pos % page_size] = True
    return hidden.to(case.live.device)


def assert_matches_reference(case: Case, window: int | None, softcap: float | None, backend=None) -> None:
    backend = backend or TritonAttentionBackend()
    scale = case.q.shape[-1] ** -0.5
    keep = case.live.clone()
    keep[case.meta.slot_mapping] = False
    keep &= ~behind_every_window(case, window)
    k_cache, v_cache = poisoned(case.k_cache, keep), poisoned(case.v_cache, keep)
    backend.write_kv(k_cache, v_cache, case.k, case.v, case.meta.slot_mapping)
    out = backend.attention(case.q, k_cache, v_cache, case.meta, scale, window=window, softcap=softcap)
    assert not out.isnan().any(), "NaN in the output: a slot behind the window or outside the prefix was read"
    ref_k, ref_v = case.k_cache.clone(), case.v_cache.clone()
    flat = case.k.shape[1:]
    ref_k.view(-1, *flat)[case.meta.slot_mapping] = case.k
    ref_v.view(-1, *flat)[case.meta.slot_mapping] = case.v
    expected = dense_reference(case.meta, ref_k, ref_v, case.q, window_masks(case.meta, window), scale, softcap)
    atol, rtol = TOLERANCES[case.q.dtype]
    torch.testing.assert_close(out, expected.to(out.dtype), atol=atol, rtol=rtol)


@RULES
@GQA
@PAGE_SIZES
def test_decode(window, softcap, heads, kv_heads, page_size):
    # seq lens 1, 9, 40, 37: several splits, some empty; with window 20 the long ones start mid-page
    case = make_case([1, 1, 1, 1], [0, 8, 39, 36], page_size, heads, kv_heads, 32, torch.float32,
                     seed=page_size + heads)
    assert_matches_reference(case, window, softcap)


@RULES
@GQA
@PAGE_SIZES
def test_extend_over_cached_prefix_in_a_mixed_step(window, softcap, heads, kv_heads, page_size):
    # 18 rows cross a 16-row tile; a decode row and a 3-row extend in the same step
    case = make_case([18, 1, 3], [27, 20, 16], page_size, heads, kv_heads, 32, torch.float32,
                     seed=2 * page_size + heads)
    assert_matches_reference(case, window, softcap)


@RULES
@PAGE_SIZES
def test_fresh_prefill(window, softcap, page_size):
    case = make_case([37, 4], [0, 0], page_size, 4, 2, 32, torch.float32, seed=3 * page_size)
    assert_matches_reference(case, window, softcap)


@pytest.mark.parametrize("window", [1, 4, 16, 17, 100])
def test_window_edges_on_16_position_pages(window):
    """Windows of one position, inside a page, exactly a page, one past a page, past every sequence;
    sequences ending on a page edge (32, 48) and one past it (33)."""
    decode = make_case([1, 1, 1], [31, 47, 32], 16, 2, 1, 32, torch.float32, seed=window)
    assert_matches_reference(decode, window, None)
    extend = make_case([16, 17, 2], [16, 31, 0], 16, 2, 1, 32, torch.float32, seed=window + 1)
    assert_matches_reference(extend, window, 2.0)


@pytest.mark.parametrize("window,softcap", [(6, None), (None, 20.0), (6, 2.0)], ids=["window", "softcap", "both"])
def test_bf16(window, softcap):
    assert_matches_reference(make_case([1, 1], [40, 3], 16, 4, 2, 64, torch.bfloat16, seed=11), window, softcap)
    assert_matches_reference(make_case([20, 1], [9, 30], 16, 4, 2, 64, torch.bfloat16, seed=12), window, softcap)


def test_forced_wide_tiles_and_many_splits(monkeypatch):
    """32-position tiles over 4-position pages, and more decode splits than the window has tiles."""
    import kernels.cuda.triton_backend as tb

    monkeypatch.setattr(tb, "TARGET_DECODE_PROGRAMS", 10_000)
    backend = TritonAttentionBackend(TileSizes(decode_block_n=32, extend_block_m=32, extend_block_n=32))
    assert_matches_reference(make_case([1, 1, 1], [90, 2, 70], 4, 3, 1, 24, torch.float32, seed=13), 45, 4.0, backend)
    assert_matches_reference(make_case([40, 5], [3, 60], 4, 3, 1, 24, torch.float32, seed=14), 45, 4.0, backend)


def test_row_tiles_taller_than_kv_tiles():
    """64 rows a program over 16-position KV tiles: a row with a window of 5 sees nothing of the
    program's first tiles, which must leave its running softmax untouched (no -inf - -inf)."""
    backend = TritonAttentionBackend(TileSizes(decode_block_n=16, extend_block_m=64, extend_block_n=16))
    assert_matches_reference(make_case([50, 3], [10, 0], 16, 2, 1, 16, torch.float32, seed=18), 5, None, backend)


def test_softcap_with_a_tree_mask():
    meta, _, (k_cache, v_cache), q, k, v, dense = tree_step(4, 4, 2, torch.float32, 15, kernel_device())
    backend = TritonAttentionBackend()
    backend.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    scale = q.shape[-1] ** -0.5
    out = backend.attention(q, k_cache, v_cache, meta, scale, softcap=1.5)
    expected = dense_reference(meta, k_cache, v_cache, q, dense, scale, 1.5)
    torch.testing.assert_close(out, expected.float(), atol=1e-5, rtol=1e-5)


def test_a_window_with_a_tree_mask_is_refused():
    meta, _, (k_cache, v_cache), q, *_ = tree_step(4, 4, 2, torch.float32, 16, kernel_device())
    with pytest.raises(NotImplementedError, match="sliding window and a tree mask"):
        TritonAttentionBackend().attention(q, k_cache, v_cache, meta, 0.25, window=8)


def test_flags_and_bad_arguments():
    backend = TritonAttentionBackend()
    assert backend.supports_window and backend.supports_softcap
    case = make_case([1], [3], 4, 2, 2, 16, torch.float32, seed=17)
    with pytest.raises(AssertionError, match="window=0 must be >= 1"):
        backend.attention(case.q, case.k_cache, case.v_cache, case.meta, 0.25, window=0)
    with pytest.raises(AssertionError, match="softcap=0.0 must be > 0"):
        backend.attention(case.q, case.k_cache, case.v_cache, case.meta, 0.25, softcap=0.0)
