"""L1: the device KV tensors, their page ownership, and the relocation version (DESIGN §5)."""

from __future__ import annotations

import torch

from cluster.protocol import KVLayout
from kernels.kv_layout import KVCacheTensors
from kv_store.page_pool import PagePool

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def kv_layout_of(kv: KVCacheTensors) -> KVLayout:
    page = kv.k[0]
    return KVLayout(num_layers=kv.num_layers, page_size=page.shape[1], num_kv_heads=page.shape[2],
                    head_dim=page.shape[3], dtype=_DTYPE_NAMES[page.dtype], element_bytes=page.element_size())


def page_bytes(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one page takes across all layers, K and V (sizes a pool before allocating it)."""
    return 2 * num_layers * page_size * num_kv_heads * head_dim * dtype.itemsize


class DevicePool:
    """Page ids (`pages`) + the tensors they index (`kv`) + `relocation_version`.

    `relocation_version` goes up whenever the tier moves KV into or out of device pages behind the
    scheduler's back (load-back from host, eviction to host, retract offload) — never on ordinary
    alloc/free. A prepared batch records it; the CUDA-graph runner replays only if it is unchanged.
    """

    def __init__(self, kv: KVCacheTensors):
        self.kv = kv
        self.layout = kv_layout_of(kv)
        self.pages = PagePool(kv.num_pages, kv.page_size)
        self.relocation_version = 0

    def bump_relocation_version(self) -> int:
        self.relocation_version += 1
        return self.relocation_version
