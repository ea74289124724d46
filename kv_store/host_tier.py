"""L2: host-memory KV pages in the device pool's layout (DESIGN §5), and landings for remote writers.

The host tier is a second page pool with its own `KVManager` (so the same ownership rules, release
path and integrity checks hold), over CPU tensors pinned when CUDA is available. A decode worker
reserves *landing* pages for a request's prompt; a prefill worker writes them through the transfer
engine. While the remote side may still write, the pages are IN_FLIGHT under a `RemoteWrite`
handle, so nothing can free and reuse them under a late write:

    reserve()  PRIVATE -> IN_FLIGHT(RemoteWrite)      the peer may write
    landed()   IN_FLIGHT -> PRIVATE, committed        the peer said "KV complete"
    abandon()  IN_FLIGHT -> PRIVATE                   the peer acked an abort or is dead
    release()  the single release path (KVManager.release)

Residency of a request's KV (which tier holds a valid copy): `kv_store/residency.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cluster.protocol import KVLayout, Landing
from kernels.kv_layout import KVCacheTensors
from kv_store.page_pool import KVOwnershipError, PagePool
from kv_store.radix_cache import NullPrefixCache, RadixPrefixCache
from kv_store.req_kv import KVManager, ReleaseReason, ReqKV


@dataclass(frozen=True)
class RemoteWrite:
    """IN_FLIGHT handle of landing pages that a remote prefill worker may be writing."""

    request_id: str


class HostTier:
    """Host page pool + tensors. Not thread-safe: owned by the decode worker's loop."""

    def __init__(self, like: KVCacheTensors, num_pages: int, enable_prefix_cache: bool = False):
        pin = torch.cuda.is_available()
        page = like.k[0]
        self.kv = KVCacheTensors.allocate(like.num_layers, num_pages, like.page_size, page.shape[2], page.shape[3],
                                          page.dtype, "cpu")
        if pin:
            self.kv = KVCacheTensors([t.pin_memory() for t in self.kv.k], [t.pin_memory() for t in self.kv.v])
        self.layout: KVLayout = self.kv.layout
        pool = PagePool(num_pages, like.page_size)
        self.kvm = KVManager(pool, RadixPrefixCache(pool) if enable_prefix_cache else NullPrefixCache(pool))

    @property
    def pool(self) -> PagePool:
        return self.kvm.pool

    def reserve(self, request_id: str, num_tokens: int, session: str, timeout_s: float) -> Landing | None:
        """Landing pages for `num_tokens` prompt tokens, lent to the remote writer; None when the
        tier is full (nothing is held then). Raises ValueError when it could never fit, even empty."""
        need = -(-num_tokens // self.pool.page_size)
        if need > self.pool.num_usable:
            raise ValueError(f"a prompt of {num_tokens} tokens needs {need} host-tier pages; this decode worker "
                             f"has {self.pool.num_usable} (raise decode.host_pages)")
        kv = self.kvm.try_open(request_id, num_tokens)
        if kv is None:
            return None
        self.pool.hand_off(kv.pages, request_id, RemoteWrite(request_id))
        k_base = tuple(t.data_ptr() for t in self.kv.k)
        v_base = tuple(t.data_ptr() for t in self.kv.v)
        return Landing(request_id, session, tuple(kv.pages), k_base, v_base, self.layout, timeout_s)

    def landed(self, request_id: str) -> ReqKV:
        """The writer reported every page written: pages return to the request, KV committed."""
        kv = self._take_back(request_id)
        self.kvm.commit(kv, kv.kv_allocated_len)
        return kv

    def abandon(self, request_id: str) -> ReqKV:
        """No more writes can come (the writer acked the abort or is dead): pages return, uncommitted."""
        return self._take_back(request_id)

    def release(self, kv: ReqKV, reason: ReleaseReason, token_ids: list[int] = ()) -> None:
        self.kvm.release(kv, reason, list(token_ids), cache=bool(token_ids))

    def check_integrity(self) -> None:
        self.kvm.check_integrity()

    def _take_back(self, request_id: str) -> ReqKV:
        kv = self.kvm.live.get(request_id)
        if kv is None:
            raise KVOwnershipError(f"no landing for request {request_id!r}: released already, or never reserved?")
        self.pool.retire(RemoteWrite(request_id))
        return kv
