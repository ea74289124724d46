"""The page copier on CUDA with a pinned host tier: pages move through the copy kernel
(`kernels/cuda/page_copy.py`, the GPU reading and writing the pinned host pages in place), byte for byte
both ways, one event per layer; and a kernel that raises leaves the job to the staged path, still
exact.

Marked `gpu`; skipped where torch sees no CUDA device (CPU CI). Run with `pytest -m gpu`.
"""

from __future__ import annotations

import pytest
import torch

from kernels.kv_layout import KVCacheTensors
from kv_store.copier import Direction, PageCopier
from kv_store.tier_copies import host_tensors

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
NUM_LAYERS, DEVICE_PAGES, HOST_PAGES = 4, 97, 161


def tiers(dtype: torch.dtype) -> tuple[KVCacheTensors, KVCacheTensors]:
    """(device pool, pinned host tier) of random bytes: page_size 16, 3 kv heads, head_dim 64."""
    device = KVCacheTensors.allocate(NUM_LAYERS, DEVICE_PAGES, 16, 3, 64, dtype, "cuda")
    host = host_tensors(device, HOST_PAGES)
    gen = torch.Generator().manual_seed(0)
    for t in (*device.k, *device.v, *host.k, *host.v):
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8, generator=gen))
    assert all(t.is_pinned() for t in host.k + host.v), "host_tensors did not pin the host tier on CUDA"
    return device, host


def pages(direction: Direction, count: int, seed: int) -> tuple[list[int], list[int]]:
    """Distinct, scattered pages (page 0 skipped) on each side of a `direction` copy."""
    gen = torch.Generator().manual_seed(seed)
    num_src, num_dst = (DEVICE_PAGES, HOST_PAGES) if direction is Direction.TO_HOST else (HOST_PAGES, DEVICE_PAGES)
    src = (torch.randperm(num_src - 1, generator=gen)[:count] + 1).tolist()
    dst = (torch.randperm(num_dst - 1, generator=gen)[:count] + 1).tolist()
    return src, dst


def copy_and_check(copier: PageCopier, direction: Direction, seed: int) -> None:
    """One job of 64 pages through `copier`, checked byte for byte against torch indexing, pages not
    named untouched; the job recorded one completed event per layer."""
    src_kv, dst_kv = (copier.device, copier.host) if direction is Direction.TO_HOST else (copier.host, copier.device)
    src_pages, dst_pages = pages(direction, 64, seed)
    expected = [d.cpu().clone() for d in dst_kv.k + dst_kv.v]
    for e, s in zip(expected, src_kv.k + src_kv.v):
        e[dst_pages] = s.cpu()[src_pages]
    job = copier.submit(direction, src_pages, dst_pages)
    assert job.wait(60.0), "the copier did not finish a 64-page job in 60 s"
    assert job.error is None, f"the copy failed: {job.error!r}"
    assert len(job.layer_events) == NUM_LAYERS, f"{len(job.layer_events)} layer events for {NUM_LAYERS} layers"
    assert all(event.query() for event in job.layer_events), "a layer event is pending after the job is done"
    for layer, (got, want) in enumerate(zip(dst_kv.k + dst_kv.v, expected)):
        assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8)), f"layer tensor {layer} differs"


@DTYPES
def test_pinned_tier_copies_through_the_kernel_both_ways(dtype):
    device, host = tiers(dtype)
    copier = PageCopier(device, host)
    try:
        assert copier.uses_kernel, "CUDA with a pinned host tier must take the copy kernel (is triton importable?)"
        for seed, direction in enumerate([Direction.TO_DEVICE, Direction.TO_HOST, Direction.TO_DEVICE]):
            copy_and_check(copier, direction, seed)
            assert copier.uses_kernel, "the kernel failed and the copier fell back: see the logged warning"
    finally:
        copier.close()


@DTYPES
def test_a_failing_kernel_falls_back_to_staged_copies(dtype, monkeypatch):
    from kernels.cuda import page_copy as kv_copy

    def refuse(*args, **kwargs):
        raise ValueError("Pointer argument cannot be accessed from Triton (cpu tensor?)")

    monkeypatch.setattr(kv_copy.PageCopy, "launch", refuse)
    device, host = tiers(dtype)
    copier = PageCopier(device, host)
    try:
        assert copier.uses_kernel
        for seed, direction in enumerate([Direction.TO_DEVICE, Direction.TO_HOST]):
            copy_and_check(copier, direction, seed)
            assert not copier.uses_kernel, "a failed kernel copy must switch the copier to staged copies for good"
    finally:
        copier.close()


def test_staged_copies_when_asked():
    device, host = tiers(torch.bfloat16)
    copier = PageCopier(device, host, use_kernel=False)
    try:
        assert not copier.uses_kernel
        for seed, direction in enumerate([Direction.TO_DEVICE, Direction.TO_HOST]):
            copy_and_check(copier, direction, seed)
    finally:
        copier.close()


@DTYPES
def test_transfer_page_digests_on_the_gpu_equal_the_cpus(dtype):
    """A device pool read in place is digested on its GPU (`kv_store/transfer/page_digest.py`); a
    landing in host memory is digested on the CPU: the same bytes give the same digests, and the same
    parts of digests over tensor-parallel ranks."""
    from kv_store.transfer.page_digest import PageDigest

    device, host = tiers(dtype)
    src, dst = pages(Direction.TO_HOST, 24, seed=5)
    for s, d in zip(src, dst):
        for a, b in zip((*host.k, *host.v), (*device.k, *device.v)):
            a[d].copy_(b[s])
    assert PageDigest(device).digests(src) == PageDigest(host).digests(dst)
    shards = [(0, 2), (2, 3)]  # a rank's parts of two decode ranks' pages, on its GPU and on the CPU
    for held in (range(0, 3), range(1, 3)):
        assert (PageDigest(device).shard_sums(src, range(0, 3), held, shards)
                == PageDigest(host).shard_sums(dst, range(0, 3), held, shards))
    PageDigest(device).damage(src[3])
    assert PageDigest(device).digests(src)[3] != PageDigest(host).digests(dst)[3]


@DTYPES
def test_the_host_tiers_copy_checks_pass_for_true_copies_and_catch_a_changed_word_on_the_gpu(dtype):
    """`kv_store/tier_sums.py` on CUDA (device digests on their own stream): a backup through the copy
    kernel and its load-back into other device pages check clean; a word changed in the device
    pages after the load is caught."""
    from types import SimpleNamespace

    from kv_store.tier_copies import TierCounters
    from kv_store.tier_sums import TierSums

    device, host = tiers(dtype)
    copier, sums, counters = PageCopier(device, host), TierSums(device, host), TierCounters()
    try:
        src, dst = pages(Direction.TO_HOST, 24, seed=7)
        assert copier.submit(Direction.TO_HOST, src, dst).wait(60.0)
        node = SimpleNamespace(id=1, pages=src, host_pages=dst)
        assert not sums.backup_differs(node, dst, counters) and set(sums.kept) == set(dst)
        back = [p for p in range(1, DEVICE_PAGES) if p not in src][:24]
        assert copier.submit(Direction.TO_DEVICE, dst, back).wait(60.0)
        load = SimpleNamespace(nodes=[node], device_pages=[back])
        assert not sums.load_differs(load, counters) and counters.l2_corrupt == 0
        device.v[1][back[5]].view(-1).view(torch.int16)[7] += 1
        assert sums.load_differs(load, counters) and counters.l2_corrupt == 1
    finally:
        copier.close()
