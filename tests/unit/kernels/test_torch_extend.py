"""The torch backend's extend paths against naive full attention in float64.

Each case builds caches holding each sequence's cached prefix (every other slot, scratch page 0
included, holds a large finite poison value, so reading a slot a sequence does not own swamps the
output, while the decode path's masked padding still multiplies it by an exact zero), writes the
step's new K/V with ``write_kv`` as a model layer does, and attends. The reference gathers each
sequence's K/V position by position from the clean prefix and the new tokens, and applies an
explicit ``[q_len, seq_len]`` causal mask in float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kernels.attention.torch_backend as torch_backend
from kernels.attention import build_attn_metadata
from kernels.attention.metadata import AttnMetadata
from kernels.attention.torch_backend import TorchAttentionBackend
from tests.helpers import random_page_tables

pytestmark = pytest.mark.isa  # ATen's CPU flash attention vectorises for this CPU

POISON = 1e4
TOLERANCES = {  # (atol, rtol) against the float64 reference
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2.5e-2, 2e-2),  # bf16 inputs to the kernel, one rounding of |o| <~ 2 is 1.6e-2
}
FLASH_OP = "aten._scaled_dot_product_flash_attention_for_cpu.default"


@dataclass
class Case:
    meta: AttnMetadata
    tables: list[list[int]]
    prefix_lens: list[int]
    k_cache: torch.Tensor  # [num_pages, page_size, kvh, hd], prefixes filled, everything else POISON
    v_cache: torch.Tensor
    q: torch.Tensor  # [T, H, hd]
    k: torch.Tensor  # [T, kvh, hd], the new tokens'
    v: torch.Tensor


def make_case(
    q_lens: list[int], prefix_lens: list[int], page_size: int, heads: int, kv_heads: int, dtype: torch.dtype,
    seed: int, head_dim: int = 16,
) -> Case:
    """Pages are a random permutation of 1..num_pages-1 dealt to the sequences in order (tables are
    non-contiguous), with two spare pages that nobody owns."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + q for p, q in zip(prefix_lens, q_lens)]
    num_pages, tables = random_page_tables(seq_lens, page_size, 2, gen)
    num_tokens = sum(q_lens)
    meta, _ = build_attn_metadata(page_size, q_lens, seq_lens, tables, [num_tokens - 1], "cpu")

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    caches = []
    for _ in range(2):
        cache = torch.full((num_pages, page_size, kv_heads, head_dim), POISON, dtype=dtype)
        flat = cache.view(-1, kv_heads, head_dim)
        for pages, prefix_len in zip(tables, prefix_lens):
            flat[slots_of(pages, page_size, prefix_len)] = randn(prefix_len, kv_heads, head_dim)
        caches.append(cache)
    return Case(meta, tables, prefix_lens, *caches, randn(num_tokens, heads, head_dim),
                randn(num_tokens, kv_heads, head_dim), randn(num_tokens, kv_heads, head_dim))


def slots_of(pages: list[int], page_size: int, num_positions: int) -> torch.Tensor:
    """[num_positions] flat cache slots of positions [0, num_positions) of a sequence."""
    pos = torch.arange(num_positions)
    return torch.tensor(pages, dtype=torch.int64)[pos // page_size] * page_size + pos % page_size


def reference(case: Case, scale: float, last_rows: int | None = None) -> torch.Tensor:
    """[T, H, hd] float64: softmax over each sequence's positions with an explicit causal mask
    (only each sequence's last ``last_rows`` query rows when given)."""
    page_size, kv_heads, head_dim = case.k_cache.shape[1:]
    heads = case.q.shape[1]
    outs = []
    qsl = case.meta.query_start_loc_cpu
    for b, (pages, prefix_len) in enumerate(zip(case.tables, case.prefix_lens)):
        rows = slice(qsl[b], qsl[b + 1])
        q_len = qsl[b + 1] - qsl[b]
        slots = slots_of(pages, page_size, prefix_len)
        k = torch.cat([case.k_cache.view(-1, kv_heads, head_dim)[slots], case.k[rows]]).double()  # [s, kvh, hd]
        v = torch.cat([case.v_cache.view(-1, kv_heads, head_dim)[slots], case.v[rows]]).double()
        k, v = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (k, v))  # [s, H, hd]
        kept = q_len if last_rows is None else min(last_rows, q_len)
        q_rows = case.q[qsl[b + 1] - kept : qsl[b + 1]].double()
        scores = torch.einsum("qhd,shd->hqs", q_rows, k) * scale  # [H, kept, s]
        q_pos = torch.arange(prefix_len + q_len - kept, prefix_len + q_len)
        mask = torch.arange(prefix_len + q_len)[None, :] <= q_pos[:, None]  # [kept, s]
        probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        outs.append(torch.einsum("hqs,shd->qhd", probs, v))
    return torch.cat(outs)


def written_caches(backend: TorchAttentionBackend, case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the case's caches with the step's new K/V written, as a model layer does first."""
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    backend.write_kv(k_cache, v_cache, case.k, case.v, case.meta.slot_mapping)
    return k_cache, v_cache


def run_step(backend: TorchAttentionBackend, case: Case, scale: float) -> torch.Tensor:
    return backend.attention(case.q, *written_caches(backend, case), case.meta, scale)


def recorded_attention(backend: TorchAttentionBackend, case: Case, scale: float) -> tuple[torch.Tensor, OpRecorder]:
    """The step's attention (new K/V written beforehand, outside the recording) and its ops."""
    caches = written_caches(backend, case)
    recorder = OpRecorder()
    with recorder:
        out = backend.attention(case.q, *caches, case.meta, scale)
    return out, recorder


def assert_matches_reference(case: Case, backend: TorchAttentionBackend) -> None:
    scale = case.q.shape[-1] ** -0.5
    out = run_step(backend, case, scale)
    assert out.dtype == case.q.dtype and out.shape == case.q.shape
    atol, rtol = TOLERANCES[case.q.dtype]
    torch.testing.assert_close(out.double(), reference(case, scale), atol=atol, rtol=rtol)


class OpRecorder(TorchDispatchMode):
    """Every aten op the backend runs, with the largest tensor it returned (numel)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        outs = result if isinstance(result, (tuple, list)) else (result,)
        numel = max((t.numel() for t in outs if isinstance(t, torch.Tensor)), default=0)
        self.calls.append((str(func), numel))
        return result

    def ops(self) -> set[str]:
        return {name for name, _ in self.calls}

    def largest(self) -> tuple[str, int]:
        return max(self.calls, key=lambda call: call[1])


GQA = pytest.mark.parametrize("heads,kv_heads", [(2, 2), (6, 2)], ids=["gqa1", "gqa3"])
PAGE_SIZES = pytest.mark.parametrize("page_size", [1, 16])
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
# 5-token prefix chunks: 37 cached positions span 8 chunks, none aligned to a 16-token page
PREFIXES = pytest.mark.parametrize("prefix_len", [0, 1, 21, 37], ids=["fresh", "one", "unaligned", "chunks"])


@GQA
@PAGE_SIZES
@DTYPES
@PREFIXES
def test_extend_matches_full_attention(heads, kv_heads, page_size, dtype, prefix_len):
    case = make_case([19], [prefix_len], page_size, heads, kv_heads, dtype, seed=prefix_len + page_size + heads)
    assert_matches_reference(case, TorchAttentionBackend(prefix_chunk_tokens=5))


@GQA
@PAGE_SIZES
@DTYPES
def test_ragged_batch_of_decode_and_extend_rows(heads, kv_heads, page_size, dtype):
    # decode rows (q=1) around a fresh prompt, a 1-token prefix, a prefix of 3 chunks + a partial one
    q_lens, prefix_lens = [1, 12, 1, 7, 2, 1], [30, 0, 0, 1, 23, 5]
    case = make_case(q_lens, prefix_lens, page_size, heads, kv_heads, dtype, seed=7 * page_size + heads)
    assert_matches_reference(case, TorchAttentionBackend(prefix_chunk_tokens=6))


@DTYPES
def test_default_chunk_and_one_token_chunks_agree_with_reference(dtype):
    case = make_case([9, 4], [40, 3], 4, 6, 2, dtype, seed=3)
    assert_matches_reference(case, TorchAttentionBackend())
    assert_matches_reference(case, TorchAttentionBackend(prefix_chunk_tokens=1))


@GQA
@DTYPES
def test_masked_sdpa_path_for_other_devices(monkeypatch, heads, kv_heads, dtype):
    """The branch other devices take (shifted causal mask), run here on CPU by switching the path."""
    monkeypatch.setattr(torch_backend, "_uses_cpu_flash", lambda device: False)
    case = make_case([1, 11, 6], [9, 0, 20], 4, heads, kv_heads, dtype, seed=heads)
    assert_matches_reference(case, TorchAttentionBackend())


def test_fresh_prompt_runs_the_flash_kernel_without_copies_of_kv():
    case = make_case([300], [0], 16, 9, 3, torch.float32, seed=1, head_dim=64)
    _, recorder = recorded_attention(TorchAttentionBackend(), case, 0.125)
    ops = recorder.ops()
    assert FLASH_OP in ops, f"SDPA took another kernel than CPU flash: {sorted(ops)}"
    assert not {op for op in ops if "softmax" in op or "bmm" in op or "repeat" in op}, sorted(ops)
    name, numel = recorder.largest()
    assert numel <= 300 * 9 * 64, f"{name} made {numel} elements: more than q itself (a [q, s] mask or scores?)"


def test_cached_prefix_extend_memory_stays_linear_in_context():
    """4096 cached + 512 new tokens (SmolLM2's heads): no tensor of the step is O(q * seq_len).

    Scores of even one head would be q * seq_len elements; the bound here is tighter: nothing
    larger than max(q_len, chunk) * H * hd, which the gathered K/V of the whole sequence would break
    too. The CPU flash kernel tiles its scores internally (it never returns them)."""
    q_len, prefix_len, chunk, heads, head_dim = 512, 4096, 1024, 9, 64
    case = make_case([q_len], [prefix_len], 16, heads, 3, torch.float32, seed=2, head_dim=head_dim)
    out, recorder = recorded_attention(TorchAttentionBackend(prefix_chunk_tokens=chunk), case, 0.125)
    name, numel = recorder.largest()
    assert numel < q_len * (prefix_len + q_len), f"{name} made {numel} elements: a [q, seq_len] mask or scores"
    assert numel <= max(q_len, chunk) * heads * head_dim, f"{name} made {numel} elements: prefix not chunked?"
    flash_calls = [op for op, _ in recorder.calls if op == FLASH_OP]
    assert len(flash_calls) == 1 + prefix_len // chunk, "one causal call for the new tokens, one per chunk"
    expected = reference(case, 0.125, last_rows=8)  # the last rows see every position; all would be slow
    torch.testing.assert_close(out[-8:].double(), expected, atol=2e-5, rtol=2e-5)


@GQA
@PAGE_SIZES
@DTYPES
def test_short_extends_are_one_masked_flash_call_each(heads, kv_heads, page_size, dtype):
    """Verify-sized extends over short sequences (around a decode row) take the one-call path: one
    masked flash call per sequence and layer, no merge, and the reference's output."""
    q_lens, prefix_lens = [4, 1, 7, 2, 32], [30, 12, 1, 47, 9]
    case = make_case(q_lens, prefix_lens, page_size, heads, kv_heads, dtype, seed=11 * page_size + heads)
    assert_matches_reference(case, TorchAttentionBackend())
    _, recorder = recorded_attention(TorchAttentionBackend(), case, 0.125)
    flash_calls = [op for op, _ in recorder.calls if op == FLASH_OP]
    assert len(flash_calls) == 4 + 1, f"{len(flash_calls)} flash calls for 4 short extends and the decode row"
    assert not {op for op in recorder.ops() if "sigmoid" in op or "logaddexp" in op}, "parts merged: the long path"
