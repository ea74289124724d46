"""`LocalTransport`: in-process peers for colocated mode and unit tests (DESIGN §7).

Peers find each other through a process-global registry `session_id -> LocalTransport`. A write
validates its sources against this endpoint's regions and its destinations against the PEER's
regions, then copies with `ctypes.memmove` before returning: the handle is DONE at once, yet the
handle API is the same as Mooncake's, so callers cannot tell the difference.

Fault injection lets other packages test their deadlines and release paths without Mooncake:

    fail_next(n)        the next n writes copy nothing and are FAILED with a TransferFailed
    corrupt_next(n)     the next n writes copy, then flip one byte of what they wrote, and are DONE
    stall_next(n)       the next n writes copy nothing and stay PENDING ...
    release_stalled()   ... until released: copied then DONE (or FAILED if `fail=True`, or if the
                        peer or its regions went away meanwhile)

One module lock guards every endpoint: a write touches two endpoints' tables, and a single lock
cannot deadlock when two endpoints write to each other.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from collections.abc import Sequence

from kv_store.transfer.base import (
    HandleRecord,
    HandleTable,
    MemoryRegion,
    PeerUnreachable,
    RegionTable,
    TransferError,
    TransferFailed,
    TransferHandle,
    TransferStatus,
    Transport,
    WriteOp,
    check_host_mapped,
    check_no_pending_reads,
    coalesce,
    validate_dst,
    validate_src,
)

_LOCK = threading.RLock()
_PEERS: dict[str, LocalTransport] = {}  # open endpoints only
_SESSION_COUNTER = itertools.count(1)


class LocalTransport(Transport):
    """In-process endpoint. `session_id` defaults to a fresh "local-<n>"; a taken name raises."""

    def __init__(self, session_id: str | None = None) -> None:
        with _LOCK:
            self.session_id = session_id or f"local-{next(_SESSION_COUNTER)}"
            if self.session_id in _PEERS:
                raise TransferError(f"local session {self.session_id!r} already open: two workers "
                                    "given the same name, or the old one never closed?")
            _PEERS[self.session_id] = self
            self._regions = RegionTable()
            self._handles = HandleTable()
            self._stalled: list[HandleRecord] = []
            self._fail_budget = 0
            self._corrupt_budget = 0
            self._stall_budget = 0
            self._closed = False

    # ---- memory --------------------------------------------------------------------------------
    def _register_region(self, addr: int, length: int) -> MemoryRegion:
        check_host_mapped(addr, length)
        with _LOCK:
            self._check_open()
            return self._regions.add(addr, length)

    def _unregister_region(self, region: MemoryRegion) -> None:
        with _LOCK:
            if self._closed:
                return  # close() already dropped every region
            check_no_pending_reads(region, self._handles)
            self._regions.remove(region)

    # ---- transfers -----------------------------------------------------------------------------
    def write(self, peer: str, ops: Sequence[WriteOp]) -> TransferHandle:
        with _LOCK:
            self._check_open()
            target = _PEERS.get(peer)
            if target is None:
                raise PeerUnreachable(f"no open local session {peer!r}: peer closed, or never started?")
            validate_src(ops, self._regions)
            validate_dst(ops, peer, target._regions)
            record = self._handles.new(peer, coalesce(ops))
            self._start(record)
            return record.handle

    def _start(self, record: HandleRecord) -> None:
        if self._fail_budget:
            self._fail_budget -= 1
            record.mark_failed(TransferFailed(f"{record.handle}: injected failure (fail_next)"))
        elif self._stall_budget:
            self._stall_budget -= 1
            self._stalled.append(record)
        else:
            _copy(record.ops)
            if self._corrupt_budget:
                self._corrupt_budget -= 1
                _flip_byte(record.ops[-1])
            record.mark_done()

    def poll(self, handle: TransferHandle) -> TransferStatus:
        with _LOCK:
            return self._handles.get(handle).status

    def error(self, handle: TransferHandle) -> TransferError | None:
        with _LOCK:
            return self._handles.get(handle).error

    def retire(self, handle: TransferHandle) -> None:
        with _LOCK:
            self._handles.retire(handle)

    def close(self) -> None:
        """Fail stalled handles, drop every region, leave the registry. Idempotent."""
        with _LOCK:
            if self._closed:
                return
            self._closed = True
            self._stalled.clear()
            self._handles.fail_all_pending(f"transport {self.session_id} closed")
            self._regions = RegionTable()
            del _PEERS[self.session_id]

    # ---- fault injection -----------------------------------------------------------------------
    def fail_next(self, num_writes: int = 1) -> None:
        """The next `num_writes` writes copy nothing and are FAILED with a `TransferFailed`."""
        with _LOCK:
            self._fail_budget += num_writes

    def corrupt_next(self, num_writes: int = 1) -> None:
        """The next `num_writes` writes copy, then flip a byte in the middle of their last op's
        destination (a corruption no transport error reports), and are DONE."""
        with _LOCK:
            self._corrupt_budget += num_writes

    def stall_next(self, num_writes: int = 1) -> None:
        """The next `num_writes` writes copy nothing and stay PENDING until `release_stalled`."""
        with _LOCK:
            self._stall_budget += num_writes

    def release_stalled(self, fail: bool = False) -> int:
        """Finish every stalled handle now; returns how many.

        With `fail=False` each is re-validated against the peer (it may have closed or unregistered
        meanwhile: then FAILED), copied, and DONE. With `fail=True` each is FAILED, nothing copied.
        """
        with _LOCK:
            stalled, self._stalled = self._stalled, []
            for record in stalled:
                self._finish_stalled(record, fail)
            return len(stalled)

    def _finish_stalled(self, record: HandleRecord, fail: bool) -> None:
        if fail:
            record.mark_failed(TransferFailed(f"{record.handle}: injected failure (release_stalled)"))
            return
        target = _PEERS.get(record.handle.peer)
        try:
            if target is None:
                raise PeerUnreachable(f"local session {record.handle.peer!r} closed while stalled")
            validate_dst(record.ops, record.handle.peer, target._regions)
        except TransferError as err:
            record.mark_failed(TransferFailed(f"{record.handle}: {err}"))
            return
        _copy(record.ops)
        record.mark_done()

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"local transport {self.session_id} is closed: used after shutdown?")


def _copy(ops: Sequence[WriteOp]) -> None:
    """memmove every op; both ends were validated against registered, host-mapped regions."""
    for op in ops:
        ctypes.memmove(op.dst_addr, op.src_addr, op.length)


def _flip_byte(op: WriteOp) -> None:
    """Invert one byte in the middle of `op`'s destination (fault injection: `corrupt_next`)."""
    at = ctypes.c_ubyte.from_address(op.dst_addr + op.length // 2)
    at.value ^= 0xFF
