"""The `Transport` interface (DESIGN §7) and the pieces every backend shares.

A transport moves bytes from this process's registered memory into a peer's registered memory:

    register(addr, length)      local memory becomes a source (and, for peers, a destination)
    write(peer, ops)            asynchronous; returns a `TransferHandle` at once
    poll(handle)                non-blocking: PENDING | DONE | FAILED
    wait(handle, timeout_s)     blocks until DONE, or raises TransferFailed / TimeoutError
    retire(handle)              forget a terminal handle (its pages may then be freed, §4 rule 2)
    close()                     outstanding handles become FAILED

Owned here: the status enum and its legal moves, the error hierarchy, the op/handle/region value
types, `coalesce`, the region table that validates every op before it reaches memmove or a
third-party engine, and the host-mapping check that turns a bogus address into a `RegistrationError`
instead of a segfault in some copy thread.
"""

from __future__ import annotations

import abc
import contextlib
import enum
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch


class TransferStatus(enum.Enum):
    """Status of one handle. PENDING -> DONE | FAILED; terminal states never change."""

    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"

    @property
    def is_terminal(self) -> bool:
        return self is not TransferStatus.PENDING

    def to(self, new: TransferStatus) -> TransferStatus:
        """The status after a legal move to `new`; raises on any move out of a terminal state."""
        if self is not TransferStatus.PENDING or new is TransferStatus.PENDING:
            raise TransferError(f"illegal transfer status move {self.name} -> {new.name}: "
                                "a handle finished twice (completed after close or after a timeout?)")
        return new


class TransferError(RuntimeError):
    """Base of every transport error; also raised for invalid ops (bad address, empty op)."""


class RegistrationError(TransferError):
    """Registering memory failed. Fatal for the worker: nothing can be sent from or into it."""


class PeerUnreachable(TransferError):
    """The peer session cannot be reached (unknown, closed, or its handshake failed)."""


class TransferFailed(TransferError):
    """A submitted write failed, timed out, or its peer died mid-way. Pages stay unusable at the peer."""


@dataclass(frozen=True)
class WriteOp:
    """Copy `length` bytes from local `src_addr` to the peer's `dst_addr`.

    The interval `[src_addr, src_addr + length)` must lie inside one local registered region and
    `[dst_addr, dst_addr + length)` inside one of the peer's regions; `length > 0`.
    """

    src_addr: int
    dst_addr: int
    length: int

    @property
    def src_end(self) -> int:
        return self.src_addr + self.length

    @property
    def dst_end(self) -> int:
        return self.dst_addr + self.length


@dataclass(frozen=True)
class TransferHandle:
    """One `write` call. Hashable: used as the IN_FLIGHT owner of KV pages until retired.

    `num_bytes` is the sum of op lengths; `num_ops` counts ops after `coalesce`.
    """

    id: int
    peer: str
    num_bytes: int
    num_ops: int


@dataclass(frozen=True)
class MemoryRegion:
    """Registered interval `[addr, addr + length)` of this process's memory."""

    addr: int
    length: int

    @property
    def end(self) -> int:
        return self.addr + self.length

    def contains(self, addr: int, length: int) -> bool:
        return self.addr <= addr and addr + length <= self.end

    def overlaps(self, other: MemoryRegion) -> bool:
        return self.addr < other.end and other.addr < self.end


def coalesce(ops: Sequence[WriteOp]) -> list[WriteOp]:
    """Ops sorted by src, with each run whose src AND dst ranges are both adjacent merged into one.

    Pure; does not validate. Example (page-first layout, pages 3,4,5 -> landing 10,11,13; 1 page = P):

        src [3P,4P) [4P,5P) [5P,6P)      dst [10P,11P) [11P,12P) [13P,14P)
        -> WriteOp(3P, 10P, 2P), WriteOp(5P, 13P, P)
    """
    merged: list[WriteOp] = []
    for op in sorted(ops, key=lambda o: (o.src_addr, o.dst_addr)):
        last = merged[-1] if merged else None
        if last is not None and last.src_end == op.src_addr and last.dst_end == op.dst_addr:
            merged[-1] = WriteOp(last.src_addr, last.dst_addr, last.length + op.length)
        else:
            merged.append(op)
    return merged


def check_host_mapped(addr: int, length: int) -> None:
    """Raise `RegistrationError` unless `[addr, addr + length)` is readable memory of this process.

    Reads /proc/self/maps (Linux); elsewhere it checks nothing. Host copies (memmove, the Mooncake TCP
    lanes) would otherwise segfault on a bogus address long after registration "succeeded".
    """
    if addr <= 0 or length <= 0:
        raise RegistrationError(f"region addr={addr:#x} length={length}: need addr > 0 and length > 0")
    if not os.path.exists("/proc/self/maps"):
        return
    covered_to = addr
    for start, end in _readable_mappings():
        if start <= covered_to < end:
            covered_to = end
            if covered_to >= addr + length:
                return
    raise RegistrationError(f"region [{addr:#x}, {addr + length:#x}) is not readable memory of this "
                            f"process (gap at {covered_to:#x}): a freed tensor or a bad data_ptr()?")


def is_host_readable(addr: int, length: int) -> bool:
    """Whether `[addr, addr + length)` is readable memory of this process (`check_host_mapped`): a
    device allocation is not (its range is reserved without access, or not mapped at all)."""
    try:
        check_host_mapped(addr, length)
    except RegistrationError:
        return False
    return True


def _readable_mappings() -> list[tuple[int, int]]:
    spans = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            bounds, perms = line.split(maxsplit=2)[:2]
            if perms.startswith("r"):
                start, end = bounds.split("-")
                spans.append((int(start, 16), int(end, 16)))
    return sorted(spans)


class RegionTable:
    """Registered regions of one endpoint. Not locked: the owning transport holds its lock."""

    def __init__(self) -> None:
        self._regions: dict[int, MemoryRegion] = {}  # addr -> region

    def add(self, addr: int, length: int) -> MemoryRegion:
        region = MemoryRegion(addr, length)
        if length <= 0:
            raise RegistrationError(f"cannot register {region}: length must be > 0")
        for other in self._regions.values():
            if other.overlaps(region):
                raise RegistrationError(f"{region} overlaps registered {other}: registered twice, "
                                        "or a view of a tensor that is already registered?")
        self._regions[addr] = region
        return region

    def remove(self, region: MemoryRegion) -> None:
        if self._regions.get(region.addr) != region:
            raise TransferError(f"{region} is not registered: unregistered twice?")
        del self._regions[region.addr]

    def find(self, addr: int, length: int) -> MemoryRegion | None:
        for region in self._regions.values():
            if region.contains(addr, length):
                return region
        return None

    def regions(self) -> list[MemoryRegion]:
        return list(self._regions.values())


def validate_src(ops: Sequence[WriteOp], local: RegionTable) -> None:
    """Raise `TransferError` naming the first op that is empty or not inside a local region."""
    if not ops:
        raise TransferError("write with no ops: nothing to transfer (an empty page list?)")
    for op in ops:
        if op.length <= 0:
            raise TransferError(f"{op}: length must be > 0")
        if local.find(op.src_addr, op.length) is None:
            raise TransferError(f"{op}: source [{op.src_addr:#x}, {op.src_end:#x}) is not inside a "
                                "registered local region (region unregistered, or a page id past the pool?)")


def validate_dst(ops: Sequence[WriteOp], peer: str, remote: RegionTable) -> None:
    """Raise `TransferError` naming the first op whose destination is not inside a region of `peer`."""
    for op in ops:
        if remote.find(op.dst_addr, op.length) is None:
            raise TransferError(f"{op}: destination [{op.dst_addr:#x}, {op.dst_end:#x}) is not inside a "
                                f"region registered by peer {peer} (stale landing address?)")


@dataclass(eq=False)
class HandleRecord:
    """A backend's mutable bookkeeping of one handle; mutated only under the backend's lock."""

    handle: TransferHandle
    ops: list[WriteOp]  # coalesced; the sources stay borrowed until the record is terminal
    status: TransferStatus = TransferStatus.PENDING
    error: TransferFailed | None = None

    def mark_done(self) -> None:
        self.status = self.status.to(TransferStatus.DONE)

    def mark_failed(self, error: TransferFailed) -> None:
        self.status = self.status.to(TransferStatus.FAILED)
        self.error = error

    def reads_from(self, region: MemoryRegion) -> bool:
        return any(region.contains(op.src_addr, op.length) for op in self.ops)


class HandleTable:
    """Handles of one transport, by id. Not locked: the owning transport holds its lock."""

    def __init__(self) -> None:
        self._next_id = 1
        self._records: dict[int, HandleRecord] = {}

    def new(self, peer: str, ops: list[WriteOp]) -> HandleRecord:
        handle = TransferHandle(self._next_id, peer, sum(op.length for op in ops), len(ops))
        self._next_id += 1
        record = self._records[handle.id] = HandleRecord(handle, ops)
        return record

    def get(self, handle: TransferHandle) -> HandleRecord:
        record = self._records.get(handle.id)
        if record is None or record.handle != handle:
            raise TransferError(f"unknown {handle}: retired already, or issued by another transport?")
        return record

    def retire(self, handle: TransferHandle) -> None:
        record = self.get(handle)
        if not record.status.is_terminal:
            raise TransferError(f"cannot retire pending {handle}: its pages are still in flight "
                                "(wait or poll until DONE/FAILED first)")
        del self._records[handle.id]

    def pending(self) -> list[HandleRecord]:
        return [r for r in self._records.values() if r.status is TransferStatus.PENDING]

    def fail_all_pending(self, reason: str) -> None:
        for record in self.pending():
            record.mark_failed(TransferFailed(f"{record.handle}: {reason}"))


def check_no_pending_reads(region: MemoryRegion, handles: HandleTable) -> None:
    """Raise before unregistering a region that a PENDING handle still reads from."""
    busy = [r.handle.id for r in handles.pending() if r.reads_from(region)]
    if busy:
        raise TransferError(f"cannot unregister {region}: handles {busy} still read from it "
                            "(pages freed before their transfers retired? DESIGN §4 rule 2)")


class Transport(abc.ABC):
    """One endpoint. Thread-safe: every public method may be called from any thread.

    Contract shared by all backends:
    - `register` yields a `MemoryRegion` for the `with` block; leaving the block unregisters it and
      raises `TransferError` instead if a PENDING handle still reads from it.
    - `write` validates every op (non-empty, src inside a local region) before anything is copied and
      raises `TransferError` naming the bad op; it raises `PeerUnreachable` when the peer is known
      dead at submit time. Otherwise it returns a handle and the copy proceeds asynchronously.
    - `poll` never blocks. A FAILED handle's reason is `error(handle)`, always a `TransferFailed`.
    - `retire` forgets a terminal handle; `close` fails outstanding handles and is idempotent.
    """

    session_id: str
    reads_device_memory: bool = False
    """Whether writes may read GPU memory in place (Mooncake's CUDA builds); False: only host memory,
    so a prefill worker with its KV on a GPU ships through staging (`prefill_worker/staging.py`)."""

    @contextlib.contextmanager
    def register(self, addr: int, length: int) -> Iterator[MemoryRegion]:
        region = self._register_region(addr, length)
        try:
            yield region
        finally:
            self._unregister_region(region)

    def register_tensor(self, t: torch.Tensor) -> contextlib.AbstractContextManager[MemoryRegion]:
        """`register` over the bytes of a contiguous tensor (its whole storage view, not more)."""
        if not t.is_contiguous():
            raise RegistrationError(f"tensor of shape {tuple(t.shape)} is not contiguous: register the "
                                    "base buffer, not a strided view")
        return self.register(t.data_ptr(), t.numel() * t.element_size())

    def wait(self, handle: TransferHandle, timeout_s: float) -> None:
        """Block until `handle` is DONE; raise its `TransferFailed`, or `TimeoutError` after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        sleep_s = 0.0002
        while True:
            status = self.poll(handle)
            if status is TransferStatus.DONE:
                return
            if status is TransferStatus.FAILED:
                error = self.error(handle)
                assert error is not None, f"{handle} FAILED with no error recorded: poll and error disagree"
                raise error
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{handle} still pending after {timeout_s} s (peer slow or hung?)")
            time.sleep(sleep_s)
            sleep_s = min(sleep_s * 2, 0.005)

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @abc.abstractmethod
    def _register_region(self, addr: int, length: int) -> MemoryRegion: ...

    @abc.abstractmethod
    def _unregister_region(self, region: MemoryRegion) -> None: ...

    @abc.abstractmethod
    def write(self, peer: str, ops: Sequence[WriteOp]) -> TransferHandle: ...

    @abc.abstractmethod
    def poll(self, handle: TransferHandle) -> TransferStatus: ...

    @abc.abstractmethod
    def error(self, handle: TransferHandle) -> TransferError | None: ...

    def settled(self, handle: TransferHandle) -> bool:
        """True when no byte of `handle` can still move: it is terminal and nothing it started is
        still running underneath (a FAILED handle's abandoned batches may still read its source
        and write its destination). Until then its source pages stay lent and the receiver must
        not reuse its destination. Never blocks."""
        return self.poll(handle).is_terminal

    @abc.abstractmethod
    def retire(self, handle: TransferHandle) -> None: ...

    @abc.abstractmethod
    def close(self) -> None: ...
