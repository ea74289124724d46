"""Where a prefill worker ships from (`prefill_worker/staging.py`): a KV pool in device memory, emulated
by an address range mapped without access (as a GPU allocation's range looks to the host), is never
registered with a transport that reads host memory; staging pages are lent and given back exactly once."""

from __future__ import annotations

import mmap
import warnings

import pytest
import torch

from kernels.kv_layout import KVCacheTensors
from kv_store.page_pool import KVOwnershipError
from kv_store.transfer.base import RegistrationError, is_host_readable
from kv_store.transfer.local import LocalTransport
from prefill_worker.staging import StagingPages, reads_in_place

PAGES, PAGE_SIZE, KV_HEADS, HEAD_DIM = 6, 4, 2, 8


@pytest.fixture
def device_range():
    """A tensor whose bytes lie in a PROT_NONE mapping: its address is real, no host read may touch it
    (nothing here reads it; the first read would fault)."""
    nbytes = PAGES * PAGE_SIZE * KV_HEADS * HEAD_DIM * 4
    region = mmap.mmap(-1, nbytes, prot=0)  # PROT_NONE
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "not writable": it is never read or written
        tensor = torch.frombuffer(region, dtype=torch.float32).view(PAGES, PAGE_SIZE, KV_HEADS, HEAD_DIM)
    yield tensor
    del tensor
    region.close()


def test_a_device_range_is_not_host_readable_and_a_host_transport_refuses_it(device_range):
    host = torch.zeros(PAGES, PAGE_SIZE, KV_HEADS, HEAD_DIM)
    assert is_host_readable(host.data_ptr(), host.numel() * 4)
    assert not is_host_readable(device_range.data_ptr(), device_range.numel() * 4)
    with LocalTransport() as transport:
        with pytest.raises(RegistrationError, match="not readable memory of this process"):
            with transport.register_tensor(device_range):
                pass
        assert reads_in_place(KVCacheTensors([host], [host.clone()]), transport)
        assert not reads_in_place(KVCacheTensors([host], [device_range]), transport)
        transport.reads_device_memory = True  # as Mooncake's CUDA build: it reads device memory itself
        assert reads_in_place(KVCacheTensors([device_range], [device_range]), transport)


def test_staging_pages_are_lent_and_given_back_once_and_copy_the_pages_named():
    gen = torch.Generator().manual_seed(0)
    device = KVCacheTensors([torch.randn(PAGES, PAGE_SIZE, KV_HEADS, HEAD_DIM, generator=gen) for _ in range(2)],
                            [torch.randn(PAGES, PAGE_SIZE, KV_HEADS, HEAD_DIM, generator=gen) for _ in range(2)])
    staging = StagingPages(device, 3)
    try:
        first = staging.take(2)
        assert first == [0, 1] and staging.num_free == 1
        assert staging.take(5) == [2] and staging.take(1) == []  # only what is free
        job = staging.copy_in([4, 1], first)
        assert job.done() and job.error is None  # a CPU copier copies inline
        for src, dst in zip((*device.k, *device.v), (*staging.kv.k, *staging.kv.v)):
            assert torch.equal(dst[0], src[4]) and torch.equal(dst[1], src[1])
        staging.give_back(first)
        staging.check_integrity()
        with pytest.raises(KVOwnershipError, match="staging page 0 given back but not lent"):
            staging.give_back([0])
        staging.give_back([2])
        assert staging.num_free == 3
        staging.check_integrity()
    finally:
        staging.close()
