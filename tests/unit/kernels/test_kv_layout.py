"""The KV cache's CPU allocation: zeros that the operating system makes as pages are first touched."""

from __future__ import annotations

import ctypes
import mmap

import pytest
import torch

from kernels.kv_layout import CPU_ALIGN_BYTES, KVCacheTensors, populate_in_background, zeros_lazy


def _resident_kib(t: torch.Tensor) -> int:
    """KiB of `t`'s memory in RAM now (mincore over its pages: exact, unlike the process's RSS)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = mmap.PAGESIZE
    first = t.data_ptr() - t.data_ptr() % page
    length = t.data_ptr() + t.numel() * t.element_size() - first
    vec = (ctypes.c_ubyte * (-(-length // page)))()
    assert libc.mincore(first, length, vec) == 0, f"mincore failed: errno {ctypes.get_errno()}"
    return sum(b & 1 for b in vec) * page // 1024


def _pool_kib(kv: KVCacheTensors) -> int:
    return sum(_resident_kib(t) for t in kv.k + kv.v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_lazy_zeros_are_zero_aligned_contiguous_and_writable(dtype):
    t = zeros_lazy((7, 16, 3, 64), dtype)
    assert t.shape == (7, 16, 3, 64) and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % CPU_ALIGN_BYTES == 0 and t.storage_offset() == 0  # compiled steps guard on offsets
    assert torch.equal(t, torch.zeros_like(t))
    t[3, 5] = 2.5
    assert t.sum().item() == 2.5 * 3 * 64 and t[3, 5, 2, 63].item() == 2.5


def test_a_cpu_pool_is_zero_without_touching_its_memory_until_used():
    """A 768 MiB pool adds (almost) nothing to the process's resident memory when made; a page written
    is paid for then. torch.zeros would make all of it resident at once (and take seconds on 2 cores)."""
    kv = KVCacheTensors.allocate(num_layers=8, num_pages=4096, page_size=16, num_kv_heads=3, head_dim=64,
                                 dtype=torch.float32, device="cpu")
    made = _pool_kib(kv)
    total_kib = 2 * 8 * kv.k[0].numel() * 4 // 1024
    assert total_kib == 786432 and made < total_kib // 20, f"{made} KiB resident of {total_kib}"
    kv.k[0][:2048].fill_(1.0)  # half of one layer's K
    assert _pool_kib(kv) - made >= kv.k[0][:2048].numel() * 4 // 1024 * 9 // 10
    assert kv.v[7][4095].abs().sum().item() == 0 and kv.k[7].abs().sum().item() == 0
    del kv


def test_populating_maps_a_lazy_pool_in_and_keeps_every_byte():
    """What a served worker runs once ready: the pool's memory becomes resident (so no request pays
    its page faults), and what requests wrote meanwhile is untouched."""
    kv = KVCacheTensors.allocate(num_layers=4, num_pages=4096, page_size=16, num_kv_heads=3, head_dim=64,
                                 dtype=torch.float32, device="cpu")
    kv.k[1][17, 3] = 1.5
    kv.v[3][4095] = -2.0
    thread = populate_in_background(kv.k + kv.v)
    if thread is None:
        pytest.fail("no madvise here: the pool would be faulted in by the requests' writes")
    thread.join(60)
    assert not thread.is_alive()
    total_kib = 8 * kv.k[0].numel() * 4 // 1024
    assert _pool_kib(kv) >= total_kib * 9 // 10, "the pool is not resident after populating"
    assert kv.k[1][17, 3].eq(1.5).all() and kv.v[3][4095].eq(-2.0).all()
    assert kv.k[1].sum().item() == 1.5 * 3 * 64 and kv.k[0].abs().sum().item() == 0


def test_populating_waits_while_the_worker_is_busy_and_goes_on_when_it_is_idle():
    """A served worker's requests come first: no chunk is mapped in while `busy()` holds."""
    import threading
    import time

    kv = KVCacheTensors.allocate(2, 1024, 16, 3, 64, torch.float32, "cpu")  # 2 x 2 x 12 MiB
    idle = threading.Event()
    thread = populate_in_background(kv.k + kv.v, busy=lambda: not idle.is_set())
    if thread is None:
        pytest.fail("no madvise here: the pool would be faulted in by the requests' writes")
    time.sleep(0.5)
    assert _pool_kib(kv) == 0 and thread.is_alive(), "populated while the worker was busy"
    idle.set()
    thread.join(60)
    assert not thread.is_alive() and _pool_kib(kv) >= 4 * kv.k[0].numel() * 4 // 1024 * 9 // 10
