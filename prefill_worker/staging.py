"""Host pages a prefill worker ships from when its transport cannot read the engine's KV in place.

A KV pool in GPU memory is not readable by a transport that copies from host memory (Mooncake's
non-CUDA build, the TCP lanes of any build without CUDA support, `LocalTransport`): its range is a
device address, not a host mapping, so registering it fails, and copying from it would fault. Such
a worker registers these staging pages instead (pinned host memory on CUDA) and ships a request's
completed pages in two moves:

    device pages --(the page copier: its own stream, after the forward's work)--> staging pages
    staging pages --(the transport's write)--> the decode worker's landing

`KVSender` decides at build (`reads_in_place`): a host-readable pool, or a transport that reads
device memory (the CUDA build of Mooncake), is shipped from in place; anything else through here.

Ownership of a staging page (one owner at a time; `check_integrity` verifies the partition):

    take(n)       free -> lent    to one request's copy and, after it, the write that reads them
    give_back(ps) lent -> free    the write retired (nothing reads them), or the copy failed or
                                  its transfer was abandoned before any write was made
"""

from __future__ import annotations

from kernels.kv_layout import KVCacheTensors
from kv_store.copier import CopyJob, Direction, PageCopier
from kv_store.page_pool import KVOwnershipError
from kv_store.tier_copies import host_tensors
from kv_store.transfer.base import Transport, is_host_readable


def reads_in_place(kv_cache: KVCacheTensors, transport: Transport) -> bool:
    """Whether `transport` can read `kv_cache`'s pages where they are: host-readable memory (a CPU
    pool), or a transport that reads device memory (`Transport.reads_device_memory`)."""
    if transport.reads_device_memory:
        return True
    return all(is_host_readable(t.data_ptr(), t.numel() * t.element_size()) for t in (*kv_cache.k, *kv_cache.v))


class StagingPages:
    """`num_pages` host pages in `device_kv`'s layout, and the copier that fills them from it.
    Not thread-safe: the prefill worker's loop owns it (the copier's thread only copies)."""

    def __init__(self, device_kv: KVCacheTensors, num_pages: int):
        assert num_pages >= 1, f"staging needs at least one page, got {num_pages}"
        self.num_pages = num_pages
        self.kv = host_tensors(device_kv, num_pages)  # [num_pages, page_size, kv_heads, head_dim] per layer, K and V
        self.copier = PageCopier(device_kv, self.kv, name="staging-copier")
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: low pages first
        self._lent: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, most: int) -> list[int]:
        """Up to `most` free pages, now lent to the caller (fewer, or none, when fewer are free)."""
        pages = [self._free.pop() for _ in range(min(most, len(self._free)))]
        self._lent.update(pages)
        return pages

    def copy_in(self, device_pages: list[int], staging_pages: list[int]) -> CopyJob:
        """Copy `device_pages[i]` -> `staging_pages[i]` (every layer, K and V). The caller keeps the
        device pages from being written or freed until the job is done."""
        return self.copier.submit(Direction.TO_HOST, device_pages, staging_pages)

    def give_back(self, pages: list[int]) -> None:
        for page in pages:
            if page not in self._lent:
                raise KVOwnershipError(f"staging page {page} given back but not lent: given back twice (a "
                                       "write retired twice, or a failed copy freed after its write)?")
            self._lent.discard(page)
            self._free.append(page)

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a staging page is free twice"
        assert not free & self._lent, f"staging pages both free and lent: {sorted(free & self._lent)}"
        assert free | self._lent == set(range(self.num_pages)), "a staging page is neither free nor lent"

    def close(self) -> None:
        self.copier.close()
