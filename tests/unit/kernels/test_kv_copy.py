"""The KV page copy kernel (`kernels/cuda/page_copy.py`) against plain torch indexing, byte for byte, and
the page copier's kernel path: exact copies through it, and the staged redo when the kernel raises.

Without CUDA the kernel runs under the Triton interpreter on CPU tensors (this directory's conftest
sets ``TRITON_INTERPRET=1``); with CUDA it runs compiled, on device tensors. Pages are compared as
bytes, so NaN payloads and any dtype compare exactly.
"""

from __future__ import annotations

import logging

import pytest
import torch

from kernels.kv_layout import KVCacheTensors
from kv_store.copier import Direction, PageCopier

pytestmark = pytest.mark.usefixtures("triton_interpreted")
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
SRC_PAGES, DST_PAGES = 23, 37  # the two sides' page counts differ, as a host tier's and a pool's do


def kernel_device() -> str:
    """Where the kernel runs: interpreted on the CPU, unless there is a GPU (then compiled)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def random_pages(num_pages: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """`[num_pages, *shape]` of random bytes (NaN and inf bit patterns included)."""
    gen = torch.Generator().manual_seed(seed)
    nbytes = num_pages * torch.Size(shape).numel() * dtype.itemsize
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(num_pages, *shape).to(kernel_device())


def page_lists(num_src: int, num_dst: int, count: int, seed: int) -> tuple[list[int], list[int]]:
    """`count` distinct source pages and `count` distinct destination pages, each in random order."""
    gen = torch.Generator().manual_seed(seed)
    src = torch.randperm(num_src, generator=gen)[:count].tolist()
    return src, torch.randperm(num_dst, generator=gen)[:count].tolist()


def assert_same_bytes(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert torch.equal(got.cpu().view(torch.uint8), expected.cpu().view(torch.uint8)), f"{what}: bytes differ"


@DTYPES
@pytest.mark.parametrize("page_shape", [(1, 2, 32), (16, 2, 32), (16, 4, 64), (1, 1, 3)],
                         ids=["ps1", "ps16", "ps16-4chunks", "odd-bytes"])
@pytest.mark.parametrize("to_larger", [True, False], ids=["to-larger", "to-smaller"])
def test_copies_exactly_the_named_pages(dtype, page_shape, to_larger):
    from kernels.cuda.page_copy import copy_pages

    num_src, num_dst = (SRC_PAGES, DST_PAGES) if to_larger else (DST_PAGES, SRC_PAGES)
    src_k, src_v = (random_pages(num_src, page_shape, dtype, seed) for seed in (1, 2))
    dst_k, dst_v = (random_pages(num_dst, page_shape, dtype, seed) for seed in (3, 4))
    src_pages, dst_pages = page_lists(num_src, num_dst, count=9, seed=len(page_shape) + page_shape[0])
    expected_k, expected_v = dst_k.clone(), dst_v.clone()
    expected_k[dst_pages] = src_k[src_pages]  # also leaves every page not named as it was
    expected_v[dst_pages] = src_v[src_pages]
    src_before = (src_k.clone(), src_v.clone())
    index = lambda pages: torch.tensor(pages, dtype=torch.int64, device=kernel_device())  # noqa: E731
    copy_pages(src_k, src_v, dst_k, dst_v, index(src_pages), index(dst_pages))
    assert_same_bytes(dst_k, expected_k, "K")
    assert_same_bytes(dst_v, expected_v, "V")
    assert_same_bytes(src_k, src_before[0], "source K (must be read only)")
    assert_same_bytes(src_v, src_before[1], "source V (must be read only)")


def test_no_pages_is_a_no_op():
    from kernels.cuda.page_copy import copy_pages

    src, dst = random_pages(4, (16, 2, 32), torch.float32, 5), random_pages(4, (16, 2, 32), torch.float32, 6)
    before = dst.clone()
    empty = torch.empty(0, dtype=torch.int64, device=kernel_device())
    copy_pages(src, src, dst, dst, empty, empty)
    assert_same_bytes(dst, before, "destination")


# ---- the page copier on its kernel path ------------------------------------------------------------

def make_kv(num_pages: int, dtype: torch.dtype, seed: int) -> KVCacheTensors:
    """3 layers of random pages (page_size 16, 2 kv heads, head_dim 32) where the kernel runs."""
    k = [random_pages(num_pages, (16, 2, 32), dtype, seed + 2 * layer) for layer in range(3)]
    v = [random_pages(num_pages, (16, 2, 32), dtype, seed + 2 * layer + 1) for layer in range(3)]
    return KVCacheTensors(k, v)


def run_job(copier: PageCopier, direction: Direction, src_pages: list[int], dst_pages: list[int]) -> None:
    job = copier.submit(direction, src_pages, dst_pages)
    assert job.wait(30.0), "the copier did not finish a 3-layer job in 30 s"
    assert job.error is None, f"the copy failed: {job.error!r}"


def assert_job_landed(src_kv, dst_kv, before, src_pages, dst_pages) -> None:
    for layer, (src, dst, old) in enumerate(zip(src_kv.k + src_kv.v, dst_kv.k + dst_kv.v, before)):
        expected = old.clone()
        expected[dst_pages] = src[src_pages]
        assert_same_bytes(dst, expected, f"layer tensor {layer}")


@pytest.mark.parametrize("direction", list(Direction))
def test_copier_kernel_path_copies_exactly(direction):
    device, host = make_kv(SRC_PAGES, torch.bfloat16, 10), make_kv(DST_PAGES, torch.bfloat16, 20)
    src_kv, dst_kv = (device, host) if direction is Direction.TO_HOST else (host, device)
    src_pages, dst_pages = page_lists(src_kv.num_pages, dst_kv.num_pages, count=7, seed=3)
    before = [t.clone() for t in dst_kv.k + dst_kv.v]
    copier = PageCopier(device, host, use_kernel=True)
    try:
        run_job(copier, direction, src_pages, dst_pages)
        assert copier.uses_kernel, "the kernel path failed and fell back: see the logged warning"
    finally:
        copier.close()
    assert_job_landed(src_kv, dst_kv, before, src_pages, dst_pages)


def test_copier_redoes_a_failed_kernel_copy_staged(monkeypatch, caplog):
    """A kernel that raises (as Triton does for a host pointer it cannot map) costs one warning; the
    job is redone staged and succeeds, and the copier stays staged."""
    from kernels.cuda import page_copy as kv_copy

    calls = []

    def refuse(*args, **kwargs):
        calls.append(1)
        raise ValueError("Pointer argument cannot be accessed from Triton (cpu tensor?)")

    monkeypatch.setattr(kv_copy.PageCopy, "launch", refuse)
    device, host = make_kv(SRC_PAGES, torch.float32, 30), make_kv(DST_PAGES, torch.float32, 40)
    copier = PageCopier(device, host, use_kernel=True)
    try:
        with caplog.at_level(logging.WARNING, logger="kv_store.copier"):
            for direction, seed in ((Direction.TO_DEVICE, 4), (Direction.TO_HOST, 5)):
                src_kv, dst_kv = (device, host) if direction is Direction.TO_HOST else (host, device)
                src_pages, dst_pages = page_lists(src_kv.num_pages, dst_kv.num_pages, count=6, seed=seed)
                before = [t.clone() for t in dst_kv.k + dst_kv.v]
                run_job(copier, direction, src_pages, dst_pages)
                assert_job_landed(src_kv, dst_kv, before, src_pages, dst_pages)
        assert not copier.uses_kernel
    finally:
        copier.close()
    assert len(calls) == 1, f"the kernel was tried {len(calls)} times: the copier must stay staged after a failure"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "cpu tensor?" in warnings[0].getMessage()
