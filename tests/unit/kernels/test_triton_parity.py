"""Triton attention backend against the torch reference, on random paged batches.

Without CUDA the kernels run under the Triton interpreter on CPU tensors (this directory's
conftest sets ``TRITON_INTERPRET=1``); with CUDA they run compiled on the device. Shapes stay small
because the interpreter executes every program in numpy.

Each case writes the step's new K/V with both backends' ``write_kv`` and then attends, as a model
layer does. The Triton copy of the cache starts with every slot outside the live prefix set to NaN
(scratch page 0, spare pages, the unused tail of last pages, the slots about to be written), so
reading any slot a sequence does not own, or missing a write, shows up as NaN in the output.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kernels.attention import BACKEND_NAMES, build_attn_metadata, get_backend
from kernels.attention.metadata import AttnMetadata
from kernels.cuda import triton_kernels as tk
from kernels.cuda.triton_backend import TileSizes, TritonAttentionBackend, num_kv_splits
from tests.helpers import random_page_tables

pytestmark = pytest.mark.usefixtures("triton_interpreted")
TOLERANCES = {  # (atol, rtol) of the Triton output against the torch backend in the same dtype
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1e-2, 1.6e-2),  # one bf16 ulp at |o| ~ 2 is 1.6e-2
}


def kernel_device() -> str:
    """Where the kernels run: read at call time, since this directory's conftest may reload them."""
    return "cpu" if tk.INTERPRETED else "cuda"


@dataclass
class Case:
    """One step: caches holding each sequence's prefix, the new tokens' q/k/v, and its metadata."""

    meta: AttnMetadata
    live: torch.Tensor  # [num_pages * page_size] bool, slots of positions [0, seq_len) of some sequence
    k_cache: torch.Tensor  # [num_pages, page_size, kvh, hd], prefixes filled, the rest random
    v_cache: torch.Tensor
    q: torch.Tensor  # [T, H, hd]
    k: torch.Tensor  # [T, kvh, hd]
    v: torch.Tensor


def make_case(
    q_lens: list[int], prefix_lens: list[int], page_size: int, heads: int, kv_heads: int, head_dim: int,
    dtype: torch.dtype, seed: int, device: str | None = None, spare_pages: int = 3,
) -> Case:
    """Pages are a random permutation of 1..num_pages-1 dealt to the sequences in order, so
    tables are non-contiguous and page 0 appears only as row padding."""
    device = device or kernel_device()
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + q for p, q in zip(prefix_lens, q_lens)]
    num_pages, tables = random_page_tables(seq_lens, page_size, spare_pages, gen)
    num_tokens = sum(q_lens)
    meta, _ = build_attn_metadata(page_size, q_lens, seq_lens, tables, [max(num_tokens - 1, 0)], device)
    live = torch.zeros(num_pages * page_size, dtype=torch.bool)
    for pages, seq_len in zip(tables, seq_lens):
        pos = torch.arange(seq_len)
        live[torch.tensor(pages, dtype=torch.int64)[pos // page_size] * page_size + pos % page_size] = True

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    cache_shape = (num_pages, page_size, kv_heads, head_dim)
    return Case(meta, live.to(device), randn(*cache_shape), randn(*cache_shape),
                randn(num_tokens, heads, head_dim), randn(num_tokens, kv_heads, head_dim),
                randn(num_tokens, kv_heads, head_dim))


def poisoned(cache: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """A copy of ``cache`` with every slot outside ``keep`` [num_slots] set to NaN."""
    out = cache.clone()
    out.view(-1, *cache.shape[2:])[~keep] = float("nan")
    return out


def run_step(backend, case: Case, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
    backend.write_kv(k_cache, v_cache, case.k, case.v, case.meta.slot_mapping)
    return backend.attention(case.q, k_cache, v_cache, case.meta, scale)


def assert_parity(case: Case, backend=None) -> None:
    """Triton (on poisoned caches) and torch (on clean ones) agree on output and on live slots."""
    backend = backend or TritonAttentionBackend()
    scale = case.q.shape[-1] ** -0.5
    prefix = case.live.clone()
    prefix[case.meta.slot_mapping] = False
    ref_k, ref_v = case.k_cache.clone(), case.v_cache.clone()
    expected = run_step(get_backend("torch"), case, ref_k, ref_v, scale)
    tri_k, tri_v = poisoned(case.k_cache, prefix), poisoned(case.v_cache, prefix)
    out = run_step(backend, case, tri_k, tri_v, scale)
    assert not out.isnan().any(), "NaN in the output: a slot outside the live prefix was read, or a write missed"
    atol, rtol = TOLERANCES[case.q.dtype]
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)
    live = case.live
    assert torch.equal(tri_k.view(-1, *tri_k.shape[2:])[live], ref_k.view(-1, *ref_k.shape[2:])[live])
    assert torch.equal(tri_v.view(-1, *tri_v.shape[2:])[live], ref_v.view(-1, *ref_v.shape[2:])[live])


GQA = pytest.mark.parametrize("heads,kv_heads", [(2, 2), (3, 1)], ids=["gqa1", "gqa3"])
PAGE_SIZES = pytest.mark.parametrize("page_size", [1, 16])
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def test_runs_under_the_interpreter_on_cpu():
    if not tk.INTERPRETED:
        pytest.skip("CUDA present: this directory runs the compiled kernels")
    from triton.runtime.interpreter import InterpretedFunction

    for kernel in (tk.write_kv_kernel, tk.decode_split_kernel, tk.decode_combine_kernel, tk.extend_kernel):
        assert isinstance(kernel, InterpretedFunction), f"{kernel} compiled: TRITON_INTERPRET set after import?"
    case = make_case([1], [4], 4, 2, 2, 16, torch.float32, seed=0)
    assert case.q.device.type == "cpu"
    assert_parity(case)


def test_registered_by_name():
    assert "triton" in BACKEND_NAMES
    assert get_backend("triton").name == "triton"


@GQA
@PAGE_SIZES
@DTYPES
def test_decode_matches_torch(heads, kv_heads, page_size, dtype):
    # seq lens 1, 9, 40: under the interpreter's 16-token tiles, 3 splits, two of them empty for seq 0
    assert_parity(make_case([1, 1, 1], [0, 8, 39], page_size, heads, kv_heads, 32, dtype, seed=page_size + heads))


@GQA
@PAGE_SIZES
@DTYPES
def test_extend_over_cached_prefix_matches_torch(heads, kv_heads, page_size, dtype):
    # 18 rows cross a 16-row tile; the 1-row sequence is an extend row inside a mixed step
    case = make_case([18, 1, 3], [7, 20, 16], page_size, heads, kv_heads, 32, dtype, seed=2 * page_size + heads)
    assert_parity(case)


@GQA
@PAGE_SIZES
@DTYPES
def test_fresh_prefill_matches_torch(heads, kv_heads, page_size, dtype):
    q_lens = [20] if page_size == 1 else [17, 4]
    case = make_case(q_lens, [0] * len(q_lens), page_size, heads, kv_heads, 32, dtype, seed=3 * page_size + heads)
    assert_parity(case)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_page_size_64_fp16_and_wide_heads(head_dim):
    """A page larger than the KV tile: one page id serves several tiles."""
    assert_parity(make_case([1, 1], [70, 3], 64, 4, 1, head_dim, torch.float16, seed=head_dim))
    assert_parity(make_case([9, 0, 2], [60, 5, 0], 64, 4, 1, head_dim, torch.float16, seed=head_dim + 1))


def test_odd_head_dim_and_forced_tiles():
    """head_dim 24 pads to a 32-wide tile; 32-token tiles with 4-token pages."""
    tiles = TileSizes(decode_block_n=32, extend_block_m=32, extend_block_n=32)
    backend = TritonAttentionBackend(tiles)
    assert_parity(make_case([1, 1, 1], [40, 2, 70], 4, 3, 1, 24, torch.float32, seed=5), backend)
    assert_parity(make_case([33, 5], [3, 30], 4, 3, 1, 24, torch.float32, seed=6), backend)


def test_decode_result_does_not_depend_on_the_split_count(monkeypatch):
    """The split count only sizes the grid (what a replayed graph keeps); any count is exact."""
    import kernels.cuda.triton_backend as tb

    backend = TritonAttentionBackend(TileSizes(decode_block_n=16, extend_block_m=16, extend_block_n=16))
    case = make_case([1, 1], [50, 6], 16, 4, 2, 32, torch.float32, seed=7)  # seq lens 51, 7: 4 tiles at most
    outs = []
    for target_programs, splits in ((1, 1), (10_000, 4)):
        monkeypatch.setattr(tb, "TARGET_DECODE_PROGRAMS", target_programs)
        assert num_kv_splits(2, 2, 51, 16) == splits
        outs.append(backend.attention(case.q, case.k_cache, case.v_cache, case.meta, 0.2))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_write_kv_writes_exactly_the_named_slots(dtype):
    gen = torch.Generator().manual_seed(8)
    num_pages, page_size, kv_heads, head_dim = 9, 4, 3, 16
    device = kernel_device()
    k_cache = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=gen).to(dtype=dtype, device=device)
    v_cache = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=gen).to(dtype=dtype, device=device)
    slots = torch.tensor([5, 4, 31, 8, 7, 35], device=device)  # page-boundary slots, out of order
    # K/V as strided views of one packed projection, as a model's qkv split hands them over
    packed = torch.randn(len(slots), 2, kv_heads, head_dim, generator=gen).to(dtype=dtype, device=device)
    k, v = packed[:, 0], packed[:, 1]  # [T, kvh, hd], non-contiguous
    before_k, before_v = k_cache.clone(), v_cache.clone()
    TritonAttentionBackend().write_kv(k_cache, v_cache, k, v, slots)

    for cache, before, new in ((k_cache, before_k, k), (v_cache, before_v, v)):
        expected = before.view(-1, kv_heads, head_dim).clone()  # [slots, kvh, hd]
        expected[slots] = new
        assert torch.equal(_bits(cache.view(-1, kv_heads, head_dim)), _bits(expected))  # the rest byte-identical


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32 if x.element_size() == 4 else torch.int16)
