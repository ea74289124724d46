"""`MooncakeTransport`: the Mooncake transfer engine behind the `Transport` interface (DESIGN §7).

The only module that imports `mooncake`, and only when a transport is built, so `kv_store.transfer`
imports without it. `_Engine` is the thin adapter (STYLE rule 10): every int status of the Python
binding becomes an exception or a `_BatchState`; nothing else calls the binding.

What the 0.3.x binding does (found by experiment with 0.3.13 `non-cuda`, TCP, and its source):

    initialize(host, "P2PHANDSHAKE", proto, dev)  0 | -1. Peers are addressed "host:rpc_port".
    register_memory(addr, len)      0 | -7 overlaps a registered region | -1 zero length.
                                    TCP does NOT check that memory exists: a bogus addr returns 0
                                    and segfaults a lane thread at the first write. Hence
                                    `is_host_readable` before registering (tcp, non-CUDA
                                    builds: `mooncake_build`; a CUDA build reads GPU memory).
    unregister_memory(addr)         0 | -3 unknown addr. Returns 0 even with writes in flight.
    transfer_submit_write(peer, src, dst, len)   batch id, or 0 if the handshake with `peer`
                                    failed (connection refused: immediate). Segment handles are
                                    cached per peer, so a peer that dies later is seen only as
                                    FAILED ops. TCP never checks `src` against local registrations.
    transfer_check_status(id)       1 done | 0 running | -1 failed | -2 timed out. It checks task 0
                                    only, and FREES the batch on 1/-1: checking it again is a
                                    use-after-free. Hence one op per batch, checked until terminal.
    get_batch_transfer_status(ids)  NOT a status query: busy-spins until done/failed/30 s. Unused.
    batch_transfer_async_write      more than MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER (1024) queued
                                    plus 1024 pending ops per peer are rejected (FAILED), and pending
                                    ones time out after 1 s. Hence the per-peer in-flight window.

Dead peers: a killed peer (RST / connection refused) fails queued ops within ~0-1 s (one 1 s
reconnect cooldown). A hung peer (SIGSTOP, partition) is worse: the ops on the 4 lanes fail after
MC_TCP_PROGRESS_TIMEOUT_SEC (30 s), but queued ops reconnect (the kernel still accepts) and stay
pending indefinitely. So every handle carries its own deadline (`transfer_timeout_s`): past it, poll
reports FAILED. Its batches become "zombies": mooncake may still read their source memory, so the
region cannot be unregistered until they finish or the transport is closed (a late write may still
land at the peer — the receiver must not trust a landing buffer whose transfer it gave up on).

Progress beyond the window is driven by `poll`/`wait`: call them regularly (each call is
non-blocking; it checks finished batches and submits more ops).

Listening: `initialize` opens two ports, the handshake RPC port and the TCP transport's acceptor
(RDMA: the RPC port only), and 0.3.x binds both to every interface whatever `hostname` says;
MC_TCP_BIND_ADDRESS does not change that. Mooncake has no authentication: whoever reaches those
ports can read and write registered memory (live KV pages). So `initialize` runs inside
`redirect_wildcard_binds`, which makes those binds use `hostname`'s address, and `_Engine` then
checks what the process actually listens on and logs a warning for any port beyond that address.
Either way, multi-node deployments must keep the transfer network on a private segment.
"""

from __future__ import annotations

import enum
import ipaddress
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kv_store.transfer import mooncake_build
from kv_store.transfer.base import (
    HandleRecord,
    HandleTable,
    MemoryRegion,
    PeerUnreachable,
    RegionTable,
    RegistrationError,
    TransferError,
    TransferFailed,
    TransferHandle,
    TransferStatus,
    Transport,
    WriteOp,
    check_no_pending_reads,
    coalesce,
    is_host_readable,
    validate_src,
)
from kv_store.transfer.bind_redirect import redirect_wildcard_binds, resolve_bind_address
from kv_store.transfer.listeners import Listener, listening_sockets

log = logging.getLogger("tandem.transfer")

MOONCAKE_QUEUE_PER_PEER = 1024  # mooncake's default MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER


class _BatchState(enum.Enum):
    """`transfer_check_status` codes. Mooncake frees the batch on COMPLETED and FAILED."""

    RUNNING = 0
    COMPLETED = 1
    FAILED = -1
    TIMED_OUT = -2

    @property
    def is_terminal(self) -> bool:
        return self is not _BatchState.RUNNING


class _Engine:
    """Thin adapter over `mooncake.engine.TransferEngine`; one error policy, no state of ours beyond
    what mooncake reports (`rpc_port`, and the `listeners` its `initialize` opened).

    Not locked: `MooncakeTransport` serialises every call under its own lock.
    """

    def __init__(self, hostname: str, protocol: str, device_name: str) -> None:
        # glog reads its level as its library loads: keep mooncake's per-connection info lines out of
        # a worker's log (unless the environment says otherwise)
        os.environ.setdefault("GLOG_minloglevel", "2")
        try:
            import mooncake.engine as binding
        except ImportError as err:
            raise TransferError("mooncake is not installed: pip install 'tandem-serve[cpu]' "
                                "(mooncake-transfer-engine-non-cuda) or use LocalTransport") from err
        try:
            address = resolve_bind_address(hostname)
        except OSError as err:
            raise TransferError(f"mooncake hostname {hostname!r}: {err}") from None
        self._te = binding.TransferEngine()
        before = {listener.inode for listener in listening_sockets(os.getpid())}
        with redirect_wildcard_binds(address, _loaded_libraries(Path(binding.__file__).parent)):
            code = self._te.initialize(hostname, "P2PHANDSHAKE", protocol, device_name)
        if code != 0:
            raise TransferError(f"mooncake initialize({hostname!r}, P2PHANDSHAKE, {protocol!r}, "
                                f"{device_name!r}) returned {code}: unknown protocol or device, or "
                                "no free RPC port?")
        self.rpc_port = int(self._te.get_rpc_port())
        self.listeners = [lst for lst in listening_sockets(os.getpid()) if lst.inode not in before]
        _warn_beyond(hostname, address, self.listeners)

    def register(self, addr: int, length: int) -> None:
        code = self._te.register_memory(addr, length)
        if code != 0:
            hint = {-7: "overlaps a registered region", -1: "zero length or device refused"}
            raise RegistrationError(f"mooncake register_memory({addr:#x}, {length}) returned {code}: "
                                    f"{hint.get(code, 'see the mooncake log above')}")

    def unregister(self, addr: int) -> None:
        code = self._te.unregister_memory(addr)
        if code != 0:
            raise TransferError(f"mooncake unregister_memory({addr:#x}) returned {code}: "
                                "not registered (unregistered twice?)")

    def submit_write(self, peer: str, op: WriteOp) -> int:
        """Batch id of a one-op write; `PeerUnreachable` if the handshake with `peer` failed."""
        batch_id = self._te.transfer_submit_write(peer, op.src_addr, op.dst_addr, op.length)
        if batch_id == 0:
            raise PeerUnreachable(f"mooncake could not open peer {peer!r} for {op}: peer not "
                                  "listening (dead, or a wrong session id?)")
        return batch_id

    def check(self, batch_id: int) -> _BatchState:
        """Non-blocking. After a terminal state mooncake has freed `batch_id`: never check it again."""
        code = self._te.transfer_check_status(batch_id)
        try:
            return _BatchState(code)
        except ValueError:
            raise TransferError(f"mooncake transfer_check_status({batch_id}) returned unknown {code}: "
                                "binding newer than this adapter?") from None

    def close(self) -> None:
        self._te = None  # the C++ destructor stops the lanes and the RPC listener


def _loaded_libraries(package_dir: Path) -> list[Path]:
    """Shared objects of the mooncake wheel mapped into this process: engine.so, its bundled libasio
    (the TCP acceptor binds there), and anything auditwheel put in the sibling `mooncake*.libs`."""
    def ours(path: Path) -> bool:
        folder = path.parent
        return folder == package_dir or (folder.parent == package_dir.parent and folder.name.startswith("mooncake")
                                         and folder.name.endswith(".libs"))

    with open("/proc/self/maps") as maps:
        mapped = {Path(fields[5].strip()) for fields in (line.split(maxsplit=5) for line in maps) if len(fields) == 6}
    return sorted(path for path in mapped if ".so" in path.name and ours(path))


def _warn_beyond(hostname: str, address: ipaddress.IPv4Address | ipaddress.IPv6Address,
                 listeners: list[Listener]) -> None:
    """Log a warning naming every port the engine opened on an address other than `address`."""
    beyond = [str(listener) for listener in listeners if listener.host != address]
    if beyond:
        log.warning("mooncake transfer engine listens on %s, not only on transport.hostname %s (%s): it has "
                    "no authentication, so anyone who reaches these ports can read and write KV memory. "
                    "Keep the transfer network on a private segment or firewall these ports.",
                    ", ".join(beyond), hostname, address)


@dataclass(eq=False)
class _Job:
    """One PENDING handle: ops not yet submitted, then batch ids in flight (oldest first)."""

    record: HandleRecord
    deadline_s: float  # time.monotonic() after which the handle is FAILED
    unsent: deque[WriteOp]
    in_flight: deque[tuple[int, WriteOp]] = field(default_factory=deque)


@dataclass(frozen=True)
class _Zombie:
    """A batch of a handle we gave up on; mooncake may still read `op`'s source."""

    peer: str
    batch_id: int
    op: WriteOp
    handle_id: int


class MooncakeTransport(Transport):
    """Mooncake endpoint in P2P-handshake mode; `session_id` is "hostname:rpc_port".

    Each op is one mooncake batch; at most `max_inflight_ops_per_peer` are submitted to one peer at a
    time (bounded by mooncake's per-peer queue), the rest wait here and are submitted by later
    `poll`/`wait` calls. A handle still PENDING `transfer_timeout_s` after `write` becomes FAILED.
    Thread-safe: one lock serialises our state and every mooncake call.
    """

    def __init__(self, hostname: str = "127.0.0.1", protocol: str = "tcp", device_name: str = "", *,
                 max_inflight_ops_per_peer: int = 512, transfer_timeout_s: float = 30.0) -> None:
        if not 1 <= max_inflight_ops_per_peer <= MOONCAKE_QUEUE_PER_PEER:
            raise ValueError(f"max_inflight_ops_per_peer={max_inflight_ops_per_peer} must be in "
                             f"[1, {MOONCAKE_QUEUE_PER_PEER}]: mooncake fails ops beyond its queue")
        if transfer_timeout_s <= 0:
            raise ValueError(f"transfer_timeout_s={transfer_timeout_s} must be > 0")
        self.protocol = protocol
        try:
            self.build = mooncake_build.checked()
        except RuntimeError as exc:
            raise TransferError(str(exc)) from None
        self.reads_device_memory = self.build is not None and self.build.reads_device_memory
        self.max_inflight_ops_per_peer = max_inflight_ops_per_peer
        self.transfer_timeout_s = transfer_timeout_s
        self._engine = _Engine(hostname, protocol, device_name)
        self.session_id = f"{hostname}:{self._engine.rpc_port}"
        self._lock = threading.Lock()
        self._regions = RegionTable()
        self._handles = HandleTable()
        self._jobs: deque[_Job] = deque()  # PENDING handles, oldest first
        self._zombies: list[_Zombie] = []
        self._in_flight_per_peer: dict[str, int] = {}  # submitted, not yet seen terminal (incl. zombies)
        self._closed = False

    # ---- memory --------------------------------------------------------------------------------
    def _register_region(self, addr: int, length: int) -> MemoryRegion:
        if self.protocol == "tcp" and not self.reads_device_memory:
            if not is_host_readable(addr, length):  # TCP lanes memcpy from it; mooncake itself never checks
                build = self.build.distribution if self.build else "mooncake"
                raise RegistrationError(
                    f"region [{addr:#x}, {addr + length:#x}) is not host memory, and {build} copies from host "
                    "memory only: GPU memory needs a CUDA build (tandem's gpu extra), or ships through host "
                    "staging (a prefill worker does that itself); otherwise a freed tensor or a bad data_ptr()")
        with self._lock:
            self._check_open()
            region = self._regions.add(addr, length)
            try:
                self._engine.register(addr, length)
            except RegistrationError:
                self._regions.remove(region)
                raise
            return region

    def _unregister_region(self, region: MemoryRegion) -> None:
        with self._lock:
            if self._closed:
                return  # the engine, and every registration with it, is gone
            self._reap_zombies()
            check_no_pending_reads(region, self._handles)
            zombies = [z.batch_id for z in self._zombies if region.contains(z.op.src_addr, z.op.length)]
            if zombies:
                raise TransferError(f"cannot unregister {region}: {len(zombies)} abandoned mooncake batches "
                                    "(timed out against a hung peer) may still read it; close() first")
            self._regions.remove(region)
            self._engine.unregister(region.addr)

    # ---- transfers -----------------------------------------------------------------------------
    def write(self, peer: str, ops: Sequence[WriteOp]) -> TransferHandle:
        with self._lock:
            self._check_open()
            validate_src(ops, self._regions)
            merged = coalesce(ops)
            first = None
            if self._window_free(peer):  # first contact handshakes here: unreachable raises now
                first = (self._engine.submit_write(peer, merged[0]), merged[0])
                self._in_flight_per_peer[peer] = self._in_flight_per_peer.get(peer, 0) + 1
            record = self._handles.new(peer, merged)
            job = _Job(record, time.monotonic() + self.transfer_timeout_s,
                       deque(merged[1:] if first else merged))
            if first:
                job.in_flight.append(first)
            self._jobs.append(job)
            self._advance(job, time.monotonic())
            return record.handle

    def poll(self, handle: TransferHandle) -> TransferStatus:
        with self._lock:
            record = self._handles.get(handle)
            if record.status is TransferStatus.PENDING:
                self._progress()
            return record.status

    def error(self, handle: TransferHandle) -> TransferError | None:
        with self._lock:
            return self._handles.get(handle).error

    def settled(self, handle: TransferHandle) -> bool:
        with self._lock:
            if not self._handles.get(handle).status.is_terminal:
                self._progress()
                if not self._handles.get(handle).status.is_terminal:
                    return False
            self._reap_zombies()
            return not any(z.handle_id == handle.id for z in self._zombies)

    def retire(self, handle: TransferHandle) -> None:
        with self._lock:
            self._handles.retire(handle)

    def close(self) -> None:
        """Fail every PENDING handle and destroy the engine (peers then see us as dead). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._handles.fail_all_pending(f"transport {self.session_id} closed")
            self._jobs.clear()
            self._zombies.clear()
            self._regions = RegionTable()
            self._engine.close()

    # ---- progress (all under self._lock) ------------------------------------------------------
    def _progress(self) -> None:
        now = time.monotonic()
        self._reap_zombies()
        for job in list(self._jobs):
            self._advance(job, now)

    def _advance(self, job: _Job, now: float) -> None:
        """Collect finished batches, enforce the deadline, submit more; drop the job when terminal."""
        self._collect(job)
        if job.record.status is TransferStatus.PENDING and now > job.deadline_s:
            self._abandon(job, f"still pending after transfer_timeout_s={self.transfer_timeout_s}: "
                               "peer hung or network partitioned?")
        if job.record.status is TransferStatus.PENDING:
            self._submit(job)
        if job.record.status is TransferStatus.PENDING and not job.unsent and not job.in_flight:
            job.record.mark_done()
        if job.record.status.is_terminal:
            self._jobs.remove(job)

    def _collect(self, job: _Job) -> None:
        while job.in_flight and job.record.status is TransferStatus.PENDING:
            batch_id, op = job.in_flight[0]
            state = self._engine.check(batch_id)
            if state is _BatchState.RUNNING:
                return
            job.in_flight.popleft()
            self._in_flight_per_peer[job.record.handle.peer] -= 1
            if state is not _BatchState.COMPLETED:
                self._abandon(job, f"{op} {state.name} at mooncake: peer died, or dst not registered there")

    def _submit(self, job: _Job) -> None:
        peer = job.record.handle.peer
        while job.unsent and self._window_free(peer):
            try:
                batch_id = self._engine.submit_write(peer, job.unsent[0])
            except PeerUnreachable as err:
                self._abandon(job, str(err))
                return
            job.in_flight.append((batch_id, job.unsent.popleft()))
            self._in_flight_per_peer[peer] += 1

    def _abandon(self, job: _Job, reason: str) -> None:
        """FAILED now; its in-flight batches become zombies, its unsent ops are dropped."""
        peer = job.record.handle.peer
        self._zombies.extend(_Zombie(peer, batch_id, op, job.record.handle.id) for batch_id, op in job.in_flight)
        job.in_flight.clear()
        job.unsent.clear()
        job.record.mark_failed(TransferFailed(f"{job.record.handle}: {reason}"))

    def _reap_zombies(self) -> None:
        alive = []
        for zombie in self._zombies:
            if self._engine.check(zombie.batch_id).is_terminal:
                self._in_flight_per_peer[zombie.peer] -= 1
            else:
                alive.append(zombie)
        self._zombies = alive

    def _window_free(self, peer: str) -> bool:
        return self._in_flight_per_peer.get(peer, 0) < self.max_inflight_ops_per_peer

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"mooncake transport {self.session_id} is closed: used after shutdown?")
