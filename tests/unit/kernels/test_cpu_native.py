"""The native CPU decode-attention kernel against naive attention in float64, and where it serves.

Every slot a sequence does not own (scratch page 0, the spare pages, the tail of its last page)
holds a large poison value: a kernel that reads past a sequence's length, or another sequence's
page, swamps its output.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from kernels.attention import build_attn_metadata
from kernels.attention.torch_backend import TorchAttentionBackend
from kernels.cpu import native as cpu_native
from kernels.cpu.attention_backend import CpuAttentionBackend
from tests.helpers import random_page_tables

pytestmark = pytest.mark.isa  # the C kernel is built for this CPU (-march)

POISON = 1e4
FLASH_OP = "aten._scaled_dot_product_flash_attention_for_cpu.default"


def make_decode(seq_lens: list[int], page_size: int, heads: int, kv_heads: int, head_dim: int, seed: int):
    """(q [B, H, hd] as a view into wider rows, like the qkv split's; k_cache, v_cache; page_table with
    two unused columns; seq_lens; tables), the caches poisoned outside each sequence's positions."""
    gen = torch.Generator().manual_seed(seed)
    num_pages, tables = random_page_tables(seq_lens, page_size, 2, gen)
    k_cache = torch.full((num_pages, page_size, kv_heads, head_dim), POISON)
    v_cache = torch.full((num_pages, page_size, kv_heads, head_dim), POISON)
    for table, n in zip(tables, seq_lens):
        for pos in range(n):
            page, slot = table[pos // page_size], pos % page_size
            k_cache[page, slot] = torch.randn(kv_heads, head_dim, generator=gen)
            v_cache[page, slot] = torch.randn(kv_heads, head_dim, generator=gen)
    width = max(len(t) for t in tables) + 2
    page_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
    rows = torch.randn(len(seq_lens), (heads + 2 * kv_heads) * head_dim, generator=gen)
    q = rows[:, : heads * head_dim].view(len(seq_lens), heads, head_dim)  # rows wider than q: q.stride(0) > H * hd
    return q, k_cache, v_cache, page_table, torch.tensor(seq_lens, dtype=torch.int64), tables


def reference(q, k_cache, v_cache, tables, seq_lens, scale) -> torch.Tensor:
    """Each sequence's K/V gathered position by position; softmax attention in float64."""
    heads, kv_heads, page_size = q.shape[1], k_cache.shape[2], k_cache.shape[1]
    out = []
    for b, (table, n) in enumerate(zip(tables, seq_lens.tolist())):
        slots = [(table[p // page_size], p % page_size) for p in range(n)]
        k = torch.stack([k_cache[pg, s] for pg, s in slots]).double()  # [n, kvh, hd]
        v = torch.stack([v_cache[pg, s] for pg, s in slots]).double()
        k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)  # [n, H, hd]
        scores = torch.einsum("hd,nhd->hn", q[b].double(), k) * scale
        out.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), v))
    return torch.stack(out)


@pytest.fixture(scope="module", autouse=True)
def native_kernel():
    assert cpu_native.kernel() is not None, "the kernel did not build: no C compiler? (see the warning logged)"


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (16, 2)], ids=["mha", "gqa3", "gqa8"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("head_dim", [64, 20])
def test_decode_matches_float64_attention(heads, kv_heads, page_size, head_dim):
    # lengths around a page, around the kernel's 32-position blocks, one position, and several blocks
    seq_lens = [1, 15, 16, 17, 31, 33, 64, 200]
    q, k_cache, v_cache, page_table, lens, tables = make_decode(seq_lens, page_size, heads, kv_heads, head_dim,
                                                                seed=heads * 100 + page_size + head_dim)
    got = cpu_native.paged_decode(q, k_cache, v_cache, page_table, lens, 0.125)
    assert got is not None and got.shape == (len(seq_lens), heads, head_dim)
    torch.testing.assert_close(got.double(), reference(q, k_cache, v_cache, tables, lens, 0.125), atol=2e-6, rtol=2e-6)


def test_large_scores_stay_finite_and_exact():
    """Scores in the hundreds (the online softmax's rescaling from one block to the next)."""
    q, k_cache, v_cache, page_table, lens, tables = make_decode([100, 70], 16, 6, 2, 32, seed=5)
    q = q * 40
    got = cpu_native.paged_decode(q, k_cache, v_cache, page_table, lens, 1.0)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), reference(q, k_cache, v_cache, tables, lens, 1.0), atol=1e-5, rtol=1e-5)


def test_inputs_it_does_not_take_fall_back():
    q, k_cache, v_cache, page_table, lens, _ = make_decode([5, 9], 4, 4, 2, 16, seed=1)
    assert cpu_native.paged_decode(q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), page_table, lens, 0.25) is None
    assert cpu_native.paged_decode(q, k_cache.transpose(1, 2), v_cache.transpose(1, 2), page_table, lens, 0.25) is None
    assert cpu_native.paged_decode(q, k_cache, v_cache, page_table.int(), lens, 0.25) is None
    many = torch.randn(2, cpu_native.kernel().tandem_max_heads() + 2, 16)  # more heads than it takes
    assert cpu_native.paged_decode(many, k_cache, v_cache, page_table, lens, 0.25) is None


def test_no_compiler_leaves_the_torch_path(monkeypatch, caplog):
    monkeypatch.setattr(cpu_native, "_compiler", lambda: None)
    monkeypatch.setattr(cpu_native, "_loaded", [])
    with caplog.at_level(logging.WARNING, logger="tandem.kernels"):
        assert cpu_native.kernel() is None
    assert "no C compiler" in caplog.text
    q, k_cache, v_cache, page_table, lens, _ = make_decode([5, 9], 4, 4, 2, 16, seed=1)
    assert cpu_native.paged_decode(q, k_cache, v_cache, page_table, lens, 0.25) is None


def _decode_step(backend, seq_lens, heads=6, kv_heads=2, head_dim=16, page_size=4):
    gen = torch.Generator().manual_seed(3)
    num_pages, tables = random_page_tables(seq_lens, page_size, 2, gen)
    meta, _ = build_attn_metadata(page_size, [1] * len(seq_lens), seq_lens, tables, list(range(len(seq_lens))), "cpu")
    k_cache = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=gen)
    q = torch.randn(len(seq_lens), heads, head_dim, generator=gen)
    return backend.attention(q, k_cache, v_cache, meta, 0.25)


def test_the_cpu_backends_decode_step_takes_it_and_agrees_with_the_torch_backends():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        seen: set = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(str(func))
            return func(*args, **(kwargs or {}))

    seq_lens = [3, 40, 17, 9]
    with Ops() as ops:
        native = _decode_step(CpuAttentionBackend(), seq_lens)
    assert FLASH_OP not in ops.seen and "aten.index_select.default" not in ops.seen, "the step gathered and ran SDPA"
    torch.testing.assert_close(native, _decode_step(TorchAttentionBackend(), seq_lens), atol=1e-5, rtol=1e-5)


def test_a_build_goes_to_the_cache_root_loads_and_replaces_older_builds(monkeypatch, tmp_path):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_native, "_loaded", [])
    stale = tmp_path / "kernels" / "cpu_kernels-0000000000000000.so"
    stale.parent.mkdir()
    stale.write_bytes(b"an older build")
    lib = cpu_native.kernel()
    assert lib is not None and lib.tandem_max_heads() > 0
    built = cpu_native._library_path(cpu_native._compiler()).name
    assert [p.name for p in (tmp_path / "kernels").glob("*.so")] == [built]


def test_workers_that_start_at_once_build_it_once(monkeypatch, tmp_path):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    builds, real_build = [], cpu_native.build

    def slow_build(compiler, path):
        builds.append(path)
        time.sleep(0.3)  # long enough for the other worker to find no library and reach the lock
        real_build(compiler, path)

    monkeypatch.setattr(cpu_native, "build", slow_build)
    libs: list = []
    workers = [threading.Thread(target=lambda: libs.append(cpu_native._build_and_load())) for _ in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=cpu_native.BUILD_TIMEOUT_S)
    assert len(libs) == 2 and all(lib is not None and lib.tandem_max_heads() > 0 for lib in libs)
    assert len(builds) == 1  # the second waited on the lock and found the first one's library


def _linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`tandem_linear` of x [M, K] float32 and weight [N, K] (float32 or bfloat16)."""
    lib, bf16 = cpu_native.kernel(), int(weight.dtype == torch.bfloat16)
    out, scratch = torch.empty(x.shape[0], weight.shape[0]), torch.empty_like(x)
    lib.tandem_linear(x.shape[0], x.data_ptr(), x.stride(0), weight.data_ptr(), None, out.data_ptr(), weight.shape[0],
                      weight.shape[1], bf16, scratch.data_ptr())
    return out


@pytest.mark.parametrize("rows", [1, 2, 3, 6])
@pytest.mark.parametrize("n,k", [(12, 64), (7, 40), (5, 9)], ids=["whole", "tails", "short"])
def test_linear_matches_float64_in_float32_and_bfloat16(rows, n, k):
    """The layers' matrix products (`matvec`: four weight rows a pass, two X rows at a time; bf16 weights
    widened, X paired into even/odd halves) against float64: N not a multiple of 4 and K not of 8 or 16
    take the scalar tails. bf16 results are the exact product rounded to bf16 once, as torch's bf16
    matmul rounds: they may differ from float64's rounding only where float32's summation order tips
    a value across a rounding boundary, never by more than one bf16 step."""
    gen = torch.Generator().manual_seed(rows * 100 + n)
    x = torch.randn(rows, k, generator=gen)
    weight = torch.randn(n, k, generator=gen)
    exact = x.double() @ weight.double().t()
    torch.testing.assert_close(_linear(x, weight).double(), exact, rtol=1e-5, atol=1e-5)
    w16 = weight.bfloat16()
    exact16 = x.double() @ w16.double().t()
    got = _linear(x, w16)
    assert torch.equal(got, got.bfloat16().float()), "bf16 results not rounded to bf16"
    step = exact16.abs().clamp_min(1e-30).log2().floor().exp2() / 128  # one bf16 ulp at each value
    assert ((got.double() - exact16).abs() <= step).all()
    assert (got == exact16.bfloat16().float()).float().mean() >= 0.9


def test_linear_rows_are_batch_invariant():
    """A row's products are summed in the same order alone, paired, or as a batch's odd last row."""
    gen = torch.Generator().manual_seed(4)
    x, weight = torch.randn(5, 200, generator=gen), torch.randn(33, 200, generator=gen)
    for w in (weight, weight.bfloat16()):
        batch = _linear(x, w)
        for i in range(5):
            assert torch.equal(_linear(x[i : i + 1].clone(), w)[0], batch[i])
