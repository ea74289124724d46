"""The landing pool: host memory where a decode worker receives a prompt's KV from a prefill worker,
and the loads that bring it to the device (docs/design.md §2, §5).

Not the host tier: the prefix tree's L2 (`kv_store/host_cache.py:HostCache`) holds cached prefixes the
tree may serve; a landing holds KV a remote writer may still be writing, which the cache must never
see. Both are page pools in the device pool's layout (`host_cache.host_tensors`: pinned on CUDA), and
both move pages to the device through the one copier (`kv_store/copier.py:PageCopier`, its copy
kernel on CUDA): a load here is a `CopyJob`, the same completion the tier's load-backs have.

The pool has its own `KVManager` (the same ownership rules, release path and integrity checks).
While the remote side may still write, landing pages are IN_FLIGHT under a `RemoteWrite` handle, so
nothing frees and reuses them under a late write; while a load copies them, both the landing pages
and the device pages are IN_FLIGHT under its job:

    reserve()     PRIVATE -> IN_FLIGHT(RemoteWrite)      the peer may write
    landed()      IN_FLIGHT -> PRIVATE, committed        the peer said "KV complete"
    abandon()     IN_FLIGHT -> PRIVATE                   the peer acked an abort or is dead
    start_load()  PRIVATE -> IN_FLIGHT(job), both pools  host -> device copy submitted
    poll_loads()  IN_FLIGHT(job) -> PRIVATE              the copy finished (or failed: `job.error`)
    release()     the single release path (KVManager.release)

Residency of a request's KV (which pool holds a valid copy): `kv_store/residency.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.protocol import KVLayout, Landing
from kv_store.copier import CopyJob, Direction, PageCopier
from kv_store.device_pool import DevicePool
from kv_store.kv_manager import KVManager, ReleaseReason, ReqKV
from kv_store.page_pool import KVOwnershipError, PagePool
from kv_store.radix_cache import NullPrefixCache
from kv_store.tier_copies import host_tensors


@dataclass(frozen=True)
class RemoteWrite:
    """IN_FLIGHT handle of landing pages that a remote prefill worker may be writing."""

    request_id: str


class LandingPool:
    """Landing pages + their tensors + loads to `device`. Not thread-safe: the decode worker's loop owns it."""

    def __init__(self, device: DevicePool, num_pages: int):
        self.device = device
        self.kv = host_tensors(device.kv, num_pages)
        self.layout: KVLayout = self.kv.layout
        pool = PagePool(num_pages, device.kv.page_size)
        self.kvm = KVManager(pool, NullPrefixCache(pool))
        self.copier = PageCopier(device.kv, self.kv, name="landing-copier")
        self._loads: dict[CopyJob, str] = {}  # in flight -> request id

    @property
    def pool(self) -> PagePool:
        return self.kvm.pool

    def reserve(self, request_id: str, num_tokens: int, session: str, timeout_s: float) -> Landing | None:
        """Landing pages for `num_tokens` prompt tokens, lent to the remote writer; None when the
        pool is full (nothing is held then). Raises ValueError when it could never fit, even empty."""
        need = -(-num_tokens // self.pool.page_size)
        if need > self.pool.num_usable:
            raise ValueError(f"a prompt of {num_tokens} tokens needs {need} landing pages; this decode worker "
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

    def release(self, kv: ReqKV, reason: ReleaseReason) -> None:
        self.kvm.release(kv, reason, [], cache=False)

    # ---- loads to the device -----------------------------------------------------------------------
    def start_load(self, landed: ReqKV, device_kv: ReqKV) -> CopyJob:
        """Copy the landed pages into `device_kv`'s pages (every layer, K and V). Both are PRIVATE to
        the request; they are IN_FLIGHT until `poll_loads` returns the job. Bumps the device pool's
        relocation version and is one of its `loads_in_flight` until done (the graph gate's)."""
        assert len(landed.pages) == len(device_kv.pages), "a load needs one device page per landing page"
        request_id = landed.req_id
        assert isinstance(request_id, str), f"landed request id {request_id!r} is not a str: not a landing's ReqKV?"
        job = self.copier.submit(Direction.TO_DEVICE, list(landed.pages), list(device_kv.pages))
        self.pool.hand_off(list(landed.pages), request_id, job)
        self.device.pages.hand_off(list(device_kv.pages), request_id, job)
        self.device.begin_load(job)
        self._loads[job] = request_id
        return job

    def poll_loads(self) -> list[tuple[str, CopyJob]]:
        """Retire and return (request id, job) for every load whose copy has ended (never blocks);
        a failed one carries `job.error`."""
        done = [(rid, job) for job, rid in self._loads.items() if job.done()]
        for _, job in done:
            del self._loads[job]
            self.pool.retire(job)
            self.device.pages.retire(job)
            self.device.end_load(job)
        return done

    def loading(self, job: CopyJob | None) -> bool:
        return job in self._loads

    def check_integrity(self) -> None:
        self.kvm.check_integrity()

    def close(self) -> None:
        self.copier.close()

    def _take_back(self, request_id: str) -> ReqKV:
        kv = self.kvm.live.get(request_id)
        if kv is None:
            raise KVOwnershipError(f"no landing for request {request_id!r}: released already, or never reserved?")
        self.pool.retire(RemoteWrite(request_id))
        return kv
