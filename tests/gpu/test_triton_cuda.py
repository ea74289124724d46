"""The Triton attention kernels compiled on CUDA, against the torch backend on the same GPU, at
serving-sized shapes; and a captured decode graph replayed over longer sequences than it saw.

Marked `gpu`; skipped where torch sees no CUDA device (CPU CI). Run with `pytest -m gpu`.
"""

from __future__ import annotations

import pytest
import torch

from kernels.attention import build_attn_metadata, get_backend

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
PAGE_SIZES = pytest.mark.parametrize("page_size", [1, 16, 64])
GQA = pytest.mark.parametrize("heads,kv_heads", [(8, 8), (32, 8), (12, 2)], ids=["gqa1", "gqa4", "gqa6"])


@pytest.fixture(scope="module")
def parity():
    """The CPU parity test's helpers, imported only when a test runs: importing triton while a
    CPU run collects this file would stop tests/unit/kernels from switching on the interpreter."""
    from tests.unit.kernels import test_triton_parity

    return test_triton_parity


def _seq_lens(count: int, low: int, high: int, seed: int) -> list[int]:
    return torch.randint(low, high, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


@DTYPES
@PAGE_SIZES
@GQA
def test_decode_batch_matches_torch_on_cuda(parity, dtype, page_size, heads, kv_heads):
    prefix_lens = [0, 1, 63, 64, 4095, *_seq_lens(27, 1, 3000, seed=page_size)]
    parity.assert_parity(parity.make_case([1] * 32, prefix_lens, page_size, heads, kv_heads, 128, dtype, seed=1))


@DTYPES
@PAGE_SIZES
@GQA
def test_extend_and_prefill_match_torch_on_cuda(parity, dtype, page_size, heads, kv_heads):
    # fresh prefill, a decode row in a mixed step, extends over prefixes that do and do not end on a page
    q_lens, prefix_lens = [700, 1, 129, 300, 64], [0, 2000, 511, 1024, 3]
    parity.assert_parity(parity.make_case(q_lens, prefix_lens, page_size, heads, kv_heads, 128, dtype, seed=2))


@pytest.mark.parametrize("head_dim", [64, 256])
def test_other_head_dims_on_cuda(parity, head_dim):
    for q_lens, prefix_lens in (([1] * 8, _seq_lens(8, 1, 2000, seed=3)), ([300, 40], [100, 0])):
        parity.assert_parity(parity.make_case(q_lens, prefix_lens, 16, 8, 2, head_dim, torch.bfloat16, seed=4))


def _decode_meta(seq_lens: list[int], page_size: int, pages_per_seq: int, seed: int):
    """Decode metadata over disjoint random pages, every table padded to ``pages_per_seq``."""
    perm = (torch.randperm(len(seq_lens) * pages_per_seq, generator=torch.Generator().manual_seed(seed)) + 1).tolist()
    tables = [perm[i * pages_per_seq : (i + 1) * pages_per_seq] for i in range(len(seq_lens))]
    meta, _ = build_attn_metadata(page_size, [1] * len(seq_lens), seq_lens, tables, [0], "cuda")
    return meta


def test_captured_decode_graph_replays_over_longer_sequences(parity):
    """The graph keeps the grid sized at capture (short sequences, one split); replayed after the
    metadata tensors are overwritten with long sequences it still equals an eager torch step."""
    batch, heads, kv_heads, head_dim, page_size, pages_per_seq = 8, 16, 4, 128, 16, 128
    dtype, scale = torch.bfloat16, head_dim**-0.5
    gen = torch.Generator(device="cuda").manual_seed(5)
    num_pages = 1 + batch * pages_per_seq
    k_cache = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=gen, device="cuda", dtype=dtype)
    v_cache = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=gen, device="cuda", dtype=dtype)
    q = torch.randn(batch, heads, head_dim, generator=gen, device="cuda", dtype=dtype)
    k = torch.randn(batch, kv_heads, head_dim, generator=gen, device="cuda", dtype=dtype)
    v = torch.randn(batch, kv_heads, head_dim, generator=gen, device="cuda", dtype=dtype)
    static = _decode_meta([3 + i for i in range(batch)], page_size, pages_per_seq, seed=6)
    triton_backend = get_backend("triton")

    def step():
        triton_backend.write_kv(k_cache, v_cache, k, v, static.slot_mapping)
        return triton_backend.attention(q, k_cache, v_cache, static, scale)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()

    long = _decode_meta(_seq_lens(batch, 1000, pages_per_seq * page_size, seed=7), page_size, pages_per_seq, seed=8)
    for name in ("seq_lens", "page_table", "slot_mapping", "query_start_loc"):
        getattr(static, name).copy_(getattr(long, name))
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    graph.replay()
    torch_backend = get_backend("torch")
    torch_backend.write_kv(ref_k, ref_v, k, v, long.slot_mapping)
    expected = torch_backend.attention(q, ref_k, ref_v, long, scale)
    atol, rtol = parity.TOLERANCES[dtype]
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
