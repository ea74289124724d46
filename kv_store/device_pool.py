"""L1: the device KV tensors, their page ownership, the relocation version and the loads writing
them (DESIGN §5)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kernels.kv_layout import KVCacheTensors
from kv_store.page_pool import PagePool

if TYPE_CHECKING:
    from kv_store.copier import CopyJob


class DevicePool:
    """Page ids (`pages`) + the tensors they index (`kv`) + `relocation_version`.

    `relocation_version` goes up whenever the tier moves KV into or out of device pages behind the
    scheduler's back (load-back from host, eviction to host, retract offload) — never on ordinary
    alloc/free. A prepared batch records it; the CUDA-graph runner replays only if it is unchanged.

    `loads_in_flight()`: every host -> device copy writing device pages now, whichever host pool it
    reads (the tier's load-backs, a decode worker's landings): the one place the graph runner asks.
    """

    def __init__(self, kv: KVCacheTensors):
        self.kv = kv
        self.layout = kv.layout
        self.pages = PagePool(kv.num_pages, kv.page_size)
        self.relocation_version = 0
        self._loads: set[CopyJob] = set()

    def bump_relocation_version(self) -> int:
        self.relocation_version += 1
        return self.relocation_version

    def begin_load(self, job: CopyJob) -> None:
        """`job` (a `CopyJob`, `.dst_pages` its device pages) writes device pages from now on."""
        self._loads.add(job)
        self.bump_relocation_version()

    def end_load(self, job: CopyJob) -> None:
        self._loads.discard(job)

    def loads_in_flight(self) -> frozenset[CopyJob]:
        return frozenset(self._loads)
