"""Tree-masked attention (speculative tree drafting): every backend against naive attention in float64.

A step mixes what an engine step with tree drafts holds: a tree verify row (each draft sees the
prefix and its ancestors), a draft-head call (a tree level of 3 rows at the end of a 7-slot window
whose other slots are earlier nodes), a plain decode row and a causal extend. The reference
gathers each sequence's K/V position by position and applies the dense ``[q, seq_len]`` mask the
tree implies (everything before the window; inside it, the mask row). RoPE positions come from the
mask's offsets, slots from the window.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kernels.attention.torch_backend as torch_backend
from kernels.attention import build_attn_metadata, get_backend
from kernels.attention.metadata import TreeMask
from kernels.cuda.triton_backend import TritonAttentionBackend
from kernels.speculative import ancestor_mask, verify_tree, verify_tree_mask
from tests.helpers import random_page_tables

pytestmark = pytest.mark.isa  # ATen's CPU flash attention vectorises for this CPU

PARENTS = [0, 0, 1, 2, 1, 5, 3]  # verify rows of the drafts' parents: rows 1 and 2 off the root, 3 and 5 off row 1
HEAD_WINDOW = [-1, -1, -1, 0, 1, 1, 4]  # node parents (node index, -1: the root) of a 7-node head window
HEAD_ROWS = [4, 5, 6]  # the level being drafted: the window's last 3 nodes


def tree_step(page_size: int, heads: int, kv_heads: int, dtype: torch.dtype, seed: int, device: str = "cpu"):
    """(meta, positions, caches, q, k, v, dense masks per sequence) for the mixed step above."""
    gen = torch.Generator().manual_seed(seed)
    verify = verify_tree_mask(PARENTS)
    head = TreeMask(ancestor_mask(HEAD_WINDOW, HEAD_ROWS), (2, 2, 2))
    q_lens = [len(PARENTS) + 1, len(HEAD_ROWS), 1, 5]
    prefix_lens = [21, 17 + len(HEAD_WINDOW) - len(HEAD_ROWS), 9, 12]
    seq_lens = [p + q for p, q in zip(prefix_lens, q_lens)]
    masks = [verify, head, None, None]
    num_pages, tables = random_page_tables(seq_lens, page_size, 2, gen)
    meta, positions = build_attn_metadata(page_size, q_lens, seq_lens, tables, [sum(q_lens) - 1], device,
                                          masks=masks)
    head_dim = 16

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    caches = [randn(num_pages, page_size, kv_heads, head_dim) for _ in range(2)]
    dense = []
    for q_len, s_len, mask in zip(q_lens, seq_lens, masks):
        if mask is None:
            rows = torch.arange(s_len - q_len, s_len)
            dense.append(torch.arange(s_len)[None, :] <= rows[:, None])
        else:
            seen = torch.ones(q_len, s_len - mask.width, dtype=torch.bool)
            dense.append(torch.cat([seen, torch.tensor(mask.visible)], dim=1))
    t = sum(q_lens)
    return meta, positions, caches, randn(t, heads, head_dim), randn(t, kv_heads, head_dim), \
        randn(t, kv_heads, head_dim), dense


def run(backend, meta, caches, q, k, v) -> tuple[torch.Tensor, list[torch.Tensor]]:
    k_cache, v_cache = (c.clone() for c in caches)
    backend.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    return backend.attention(q, k_cache, v_cache, meta, q.shape[-1] ** -0.5), [k_cache, v_cache]


def reference(meta, written: list[torch.Tensor], q: torch.Tensor, dense: list[torch.Tensor]) -> torch.Tensor:
    """[T, H, hd] float64 over the written caches, with each sequence's dense mask."""
    page_size, kv_heads, head_dim = written[0].shape[1:]
    heads, outs, qsl = q.shape[1], [], meta.query_start_loc_cpu
    for b, s_len in enumerate(meta.seq_lens_cpu):
        pos = torch.arange(s_len)
        slots = meta.page_table[b].cpu()[pos // page_size] * page_size + pos % page_size
        k, v = (c.cpu().view(-1, kv_heads, head_dim)[slots].double().repeat_interleave(heads // kv_heads, 1)
                for c in written)
        scores = torch.einsum("qhd,shd->hqs", q[qsl[b]:qsl[b + 1]].cpu().double(), k) * head_dim ** -0.5
        outs.append(torch.einsum("hqs,shd->qhd", scores.masked_fill(~dense[b], float("-inf")).softmax(-1), v))
    return torch.cat(outs)


def test_metadata_positions_come_from_depths_and_slots_from_the_window():
    meta, positions, *_ = tree_step(4, 2, 2, torch.float32, seed=0)
    verify_positions = positions[:len(PARENTS) + 1].tolist()
    assert verify_positions == [21 + d for d in (0, 1, 1, 2, 2, 2, 3, 3)]
    head_positions = positions[len(PARENTS) + 1:len(PARENTS) + 4].tolist()
    assert head_positions == [17 + 2] * 3  # window start + offset
    assert not meta.decode_only
    pages = meta.page_table[0].tolist()
    assert meta.slot_mapping[:8].tolist() == [pages[p // 4] * 4 + p % 4 for p in range(21, 29)]


def test_a_mask_row_must_see_itself_and_nothing_after_it():
    with pytest.raises(AssertionError, match="sees its own slot"):
        build_attn_metadata(1, [2], [5], [[1, 2, 3, 4, 5]], [1], "cpu",
                            masks=[TreeMask(((True, False), (True, False)), (0, 1))])
    with pytest.raises(AssertionError, match="none after it"):
        build_attn_metadata(1, [2], [5], [[1, 2, 3, 4, 5]], [1], "cpu",
                            masks=[TreeMask(((True, True), (True, True)), (0, 1))])


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (6, 2)], ids=["gqa1", "gqa3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cpu_flash", [True, False], ids=["cpu-flash", "sdpa-mask"])
def test_torch_backend_matches_masked_reference(monkeypatch, page_size, heads, kv_heads, dtype, cpu_flash):
    monkeypatch.setattr(torch_backend, "_uses_cpu_flash", lambda device: cpu_flash)
    meta, _, caches, q, k, v, dense = tree_step(page_size, heads, kv_heads, dtype, seed=page_size + heads)
    out, written = run(get_backend("torch"), meta, caches, q, k, v)
    expected = reference(meta, written, q, dense)
    atol = 1e-5 if dtype == torch.float32 else 2.5e-2
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=atol)
    causal = reference(meta, written, q, [torch.ones_like(m).tril(m.shape[1] - m.shape[0]) for m in dense])
    assert (causal[:8] - expected[:8]).abs().max() > 0.1, "the tree mask made no difference: test too weak"


@pytest.mark.usefixtures("triton_interpreted")
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (3, 1)], ids=["gqa1", "gqa3"])
def test_triton_backend_matches_masked_reference(page_size, heads, kv_heads):
    from kernels.cuda import triton_kernels as tk

    device = "cpu" if tk.INTERPRETED else "cuda"
    meta, _, caches, q, k, v, dense = tree_step(page_size, heads, kv_heads, torch.float32, seed=3, device=device)
    out, written = run(TritonAttentionBackend(), meta, caches, q, k, v)
    torch.testing.assert_close(out.double().cpu(), reference(meta, written, q, dense), atol=1e-5, rtol=1e-5)


def test_flashinfer_declines_tree_masks():
    from kernels.attention.base import AttentionBackend

    assert AttentionBackend.supports_tree_mask and get_backend("torch").supports_tree_mask
    source = Path(torch_backend.__file__).parents[1] / "cuda" / "flashinfer_backend.py"
    assert "supports_tree_mask = False" in source.read_text()


def test_greedy_tree_verification_follows_the_target_through_the_tree():
    drafts = [10, 11, 12, 13, 14, 15, 16]  # rows 1..7, parents PARENTS
    # row 0 wants 10 (row 1), row 1 wants 14 (row 5), row 5 wants 15 (row 6), row 6 wants 99: stop
    argmax = [10, 14, 0, 0, 0, 15, 99, 0]
    assert verify_tree(argmax, drafts, PARENTS) == ([10, 14, 15, 99], [1, 5, 6])
    assert verify_tree([7] + [0] * 7, drafts, PARENTS) == ([7], [])  # no child of the root matches
    argmax = [11, 0, 12, 0, 0, 0, 0, 0]  # row 2 (token 11), then 12: row 3 holds it, but under row 1
    assert verify_tree(argmax, drafts, PARENTS) == ([11, 12], [2])
