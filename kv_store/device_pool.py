"""L1: the device KV tensors, their page ownership, and the relocation version (DESIGN §5)."""

from __future__ import annotations

from kernels.kv_layout import KVCacheTensors
from kv_store.page_pool import PagePool


class DevicePool:
    """Page ids (`pages`) + the tensors they index (`kv`) + `relocation_version`.

    `relocation_version` goes up whenever the tier moves KV into or out of device pages behind the
    scheduler's back (load-back from host, eviction to host, retract offload) — never on ordinary
    alloc/free. A prepared batch records it; the CUDA-graph runner replays only if it is unchanged.
    """

    def __init__(self, kv: KVCacheTensors):
        self.kv = kv
        self.layout = kv.layout
        self.pages = PagePool(kv.num_pages, kv.page_size)
        self.relocation_version = 0

    def bump_relocation_version(self) -> int:
        self.relocation_version += 1
        return self.relocation_version
