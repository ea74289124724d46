"""The page copier on the host: byte-exact copies both ways, and none of torch's parallel CPU ops on
its thread (they must stay on the worker's one compute thread: docs/design.md)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from kernels.kv_layout import KVCacheTensors
from kv_store.copier import Direction, PageCopier

NUM_PAGES = 64


def _filled(dtype: torch.dtype, seed: int) -> KVCacheTensors:
    kv = KVCacheTensors.allocate(3, NUM_PAGES, 16, 2, 32, dtype, "cpu")
    gen = torch.Generator().manual_seed(seed)
    for t in kv.k + kv.v:
        t.copy_(torch.randn(t.shape, generator=gen).to(dtype))
    return kv


@pytest.mark.parametrize("inline", [None, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("direction", list(Direction))
def test_copies_exactly_the_named_pages_both_ways(dtype, direction, inline):
    device, host = _filled(dtype, 1), _filled(dtype, 2)
    src_kv, dst_kv = (device, host) if direction is Direction.TO_HOST else (host, device)
    before = [t.clone() for t in dst_kv.k + dst_kv.v]
    src_pages, dst_pages = [5, 1, 30, 7], [2, 40, 9, 63]
    copier = PageCopier(device, host, inline=inline)
    assert copier.inline is (inline is None)  # a CPU device copies inline by default
    try:
        job = copier.submit(direction, src_pages, dst_pages)
        assert job.done() or inline is False  # inline: done when submit returns
        assert job.wait(10.0) and job.error is None
    finally:
        copier.close()
    for src, dst, old in zip(src_kv.k + src_kv.v, dst_kv.k + dst_kv.v, before):
        expected = old.clone()
        expected[dst_pages] = src[src_pages]
        assert torch.equal(dst.view(torch.uint8), expected.view(torch.uint8))  # bytes, NaN-proof


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts OS threads in /proc")
def test_the_copier_thread_starts_no_openmp_team():
    """torch's parallel CPU ops on a second thread start a second OpenMP team; with more threads
    than cores, libgomp stops spinning between parallel regions, and every later step of the compute
    thread waits for its workers to wake (measured: a decode step ~1.8x slower on 2 cores). A job
    far above torch's parallel grain must start no thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        kv_a, kv_b = _filled(torch.float32, 3), _filled(torch.float32, 4)
        copier = PageCopier(kv_a, kv_b, inline=False)  # the thread GPU copiers use
        try:
            before = _os_threads()
            pages = list(range(1, NUM_PAGES))  # 63 pages x 1,024 values per layer tensor: above the grain
            for direction in Direction:
                job = copier.submit(direction, pages, pages[::-1])
                assert job.wait(10.0) and job.error is None
            assert _os_threads() == before, "the copier's thread started OpenMP workers"
        finally:
            copier.close()
    finally:
        torch.set_num_threads(threads)


def test_an_inline_copier_runs_on_the_callers_thread_and_refuses_after_close():
    import threading

    kv_a, kv_b = _filled(torch.float32, 5), _filled(torch.float32, 6)
    copier = PageCopier(kv_a, kv_b)
    threads = {t.name for t in threading.enumerate()}
    job = copier.submit(Direction.TO_HOST, [3], [4])
    assert job.done() and job.error is None and torch.equal(kv_b.k[0][4], kv_a.k[0][3])
    assert {t.name for t in threading.enumerate()} == threads, "an inline copier started a thread"
    copier.close()
    with pytest.raises(RuntimeError, match="closed"):
        copier.submit(Direction.TO_HOST, [3], [4])


def test_a_threaded_copier_dropped_without_close_stops_its_thread_and_frees_the_kv():
    import gc
    import threading
    import weakref

    kv_a, kv_b = _filled(torch.float32, 7), _filled(torch.float32, 8)
    copier = PageCopier(kv_a, kv_b, inline=False)
    assert copier.submit(Direction.TO_HOST, [1], [2]).wait(10.0)
    thread, device = copier._thread, weakref.ref(kv_a.k[0])
    del copier, kv_a
    gc.collect()
    thread.join(5.0)
    assert device() is None, "the copier's thread kept the KV alive"
    assert not thread.is_alive() and thread not in threading.enumerate()
