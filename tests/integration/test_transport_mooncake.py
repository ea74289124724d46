"""MooncakeTransport over real TCP on 127.0.0.1 between two OS processes.

The receiver is a spawned child (`mooncake_peer.serve`); the parent writes into its buffer and asks
for a snapshot to compare bytes. Children are killed in `finally` blocks whatever happens.
"""

from __future__ import annotations

import contextlib
import importlib.util
import ipaddress
import logging
import multiprocessing
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from kv_store.transfer import (
    MooncakeTransport,
    PeerUnreachable,
    RegistrationError,
    TransferError,
    TransferFailed,
    TransferStatus,
    WriteOp,
    measure_write_bandwidth,
)
from kv_store.transfer import mooncake as mooncake_adapter
from kv_store.transfer.listeners import listening_sockets
from kv_store.transfer.mooncake import _Engine
from tests.integration import mooncake_peer

pytestmark = pytest.mark.skipif(importlib.util.find_spec("mooncake") is None,
                                reason="mooncake-transfer-engine not installed")

PEER_BYTES = 8 << 20
KIB = 1 << 10


@dataclass
class Peer:
    """A receiver child process and where its registered buffer is."""

    process: multiprocessing.Process
    conn: multiprocessing.connection.Connection
    session_id: str
    addr: int
    length: int

    def snapshot(self) -> torch.Tensor:
        self.conn.send("snapshot")
        assert self.conn.poll(30), "peer did not answer a snapshot within 30 s"
        return torch.frombuffer(bytearray(self.conn.recv_bytes()), dtype=torch.uint8)


@contextlib.contextmanager
def spawn_peer(num_bytes: int = PEER_BYTES) -> Iterator[Peer]:
    ctx = multiprocessing.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe()
    process = ctx.Process(target=mooncake_peer.serve, args=(child_conn, num_bytes), daemon=True)
    process.start()
    try:
        assert parent_conn.poll(60), "peer did not report its session within 60 s"
        session_id, addr, length = parent_conn.recv()
        yield Peer(process, parent_conn, session_id, addr, length)
        with contextlib.suppress(OSError):
            parent_conn.send("quit")
        process.join(10)
    finally:
        if process.is_alive():
            process.kill()
        process.join(10)


@contextlib.contextmanager
def sender(num_bytes: int, seed: int = 0, **kwargs) -> Iterator[tuple[MooncakeTransport, torch.Tensor, int]]:
    """A transport with a registered random source buffer: (transport, src, src_addr)."""
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, generator=gen)  # [num_bytes]
    with MooncakeTransport("127.0.0.1", **kwargs) as transport:
        with transport.register_tensor(src) as region:
            yield transport, src, region.addr


@pytest.fixture(scope="module")
def peer():
    with spawn_peer() as p:
        yield p


def expected(peer_before: torch.Tensor, src: torch.Tensor, src_addr: int, peer: Peer, ops) -> torch.Tensor:
    out = peer_before.clone()
    for op in ops:
        s, d = op.src_addr - src_addr, op.dst_addr - peer.addr
        out[d:d + op.length] = src[s:s + op.length]
    return out


def scattered_ops(src_addr: int, dst_addr: int, sizes: list[int], gap: int) -> list[WriteOp]:
    """Consecutive source chunks written in reverse order to destinations `gap` bytes apart."""
    ops, s, d = [], 0, 0
    for size in sizes:
        ops.append(WriteOp(src_addr + s, dst_addr + d, size))
        s, d = s + size, d + size + gap
    dst_ends = [op.dst_end for op in ops]
    return [WriteOp(op.src_addr, dst_addr + max(dst_ends) - op.dst_end, op.length) for op in ops]


def test_bytes_arrive_byte_identical(peer):
    sizes = [64 * KIB, 512 * KIB, 4 * KIB, 1024 * KIB, 96 * KIB, 2048 * KIB, 256 * KIB, 8 * KIB]
    sizes += [100 * KIB] * 10  # 5 MiB in all, 18 ops
    before = peer.snapshot()
    with sender(8 << 20) as (transport, src, src_addr):
        ops = scattered_ops(src_addr, peer.addr, sizes, gap=12 * KIB)
        handle = transport.write(peer.session_id, ops)
        transport.wait(handle, timeout_s=30)
        assert (handle.num_bytes, handle.num_ops) == (sum(sizes), len(ops))
        after = peer.snapshot()
    assert sum(sizes) > 4 << 20
    assert torch.equal(after, expected(before, src, src_addr, peer, ops))
    assert not torch.equal(after, before)


def test_more_ops_than_window_are_paced(peer):
    """2048 mirrored 1 KiB ops with a window of 64: submitted by later polls, all land."""
    before = peer.snapshot()
    with sender(2 << 20, seed=1, max_inflight_ops_per_peer=64) as (transport, src, src_addr):
        n = 2048
        ops = [WriteOp(src_addr + i * KIB, peer.addr + (n - 1 - i) * KIB, KIB) for i in range(n)]
        handle = transport.write(peer.session_id, ops)
        assert handle.num_ops == n and transport.poll(handle) is TransferStatus.PENDING
        transport.wait(handle, timeout_s=30)
        after = peer.snapshot()
    assert torch.equal(after, expected(before, src, src_addr, peer, ops))


def test_dst_outside_peer_region_fails_and_writes_nothing(peer):
    before = peer.snapshot()
    with sender(64 * KIB) as (transport, src, src_addr):
        handle = transport.write(peer.session_id, [WriteOp(src_addr, peer.addr + peer.length - KIB, 4 * KIB)])
        with pytest.raises(TransferFailed, match="FAILED at mooncake"):
            transport.wait(handle, timeout_s=30)
        assert transport.poll(handle) is TransferStatus.FAILED
    assert torch.equal(peer.snapshot(), before)


def test_src_outside_local_region_never_reaches_mooncake(peer):
    with sender(64 * KIB) as (transport, src, src_addr):
        with pytest.raises(TransferError, match="not inside a registered local region"):
            transport.write(peer.session_id, [WriteOp(src_addr + 60 * KIB, peer.addr, 8 * KIB)])


def test_unknown_peer_unreachable_immediately():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    with sender(64 * KIB) as (transport, src, src_addr):
        start = time.monotonic()
        with pytest.raises(PeerUnreachable):
            transport.write(dead, [WriteOp(src_addr, 0x10000, KIB)])
        assert time.monotonic() - start < 5


def test_write_after_peer_killed_fails_within_bound():
    with spawn_peer(4 << 20) as victim, sender(4 << 20) as (transport, src, src_addr):
        transport.wait(transport.write(victim.session_id, [WriteOp(src_addr, victim.addr, KIB)]), 30)
        assert torch.equal(victim.snapshot()[:KIB], src[:KIB])  # connected and working
        os.kill(victim.process.pid, signal.SIGKILL)
        victim.process.join(10)
        start = time.monotonic()
        with pytest.raises((TransferFailed, PeerUnreachable)):
            handle = transport.write(victim.session_id, [WriteOp(src_addr, victim.addr, 4 << 20)])
            transport.wait(handle, timeout_s=30)
        assert time.monotonic() - start < 30


def test_hung_peer_fails_at_adapter_deadline_and_poll_never_blocks():
    """A stopped peer keeps TCP connections open: mooncake alone would leave ops pending for good."""
    with spawn_peer(PEER_BYTES) as victim, sender(PEER_BYTES, transfer_timeout_s=2.0) as (transport, src, src_addr):
        transport.wait(transport.write(victim.session_id, [WriteOp(src_addr, victim.addr, KIB)]), 30)
        os.kill(victim.process.pid, signal.SIGSTOP)
        try:
            ops = [WriteOp(src_addr + i * (1 << 20), victim.addr + i * (1 << 20), 1 << 20) for i in range(8)]
            start = time.monotonic()
            handle = transport.write(victim.session_id, ops[::-1])  # reversed: 8 separate ops
            slowest_poll_s = 0.0
            while (status := _timed_poll(transport, handle))[0] is TransferStatus.PENDING:
                slowest_poll_s = max(slowest_poll_s, status[1])
                assert time.monotonic() - start < 20, "adapter deadline not enforced"
                time.sleep(0.01)
            assert status[0] is TransferStatus.FAILED
            assert 1.9 < time.monotonic() - start < 10
            assert slowest_poll_s < 0.5
            assert "transfer_timeout_s" in str(transport.error(handle))
            assert not transport.settled(handle), "FAILED, but its abandoned batches may still write the peer"
            os.kill(victim.process.pid, signal.SIGCONT)  # the peer wakes: the abandoned batches finish
            settle_by = time.monotonic() + 40
            while not transport.settled(handle):
                assert time.monotonic() < settle_by, "abandoned batches never settled after the peer resumed"
                time.sleep(0.05)
            transport.close()
        finally:
            os.kill(victim.process.pid, signal.SIGKILL)


def _timed_poll(transport, handle) -> tuple[TransferStatus, float]:
    start = time.monotonic()
    status = transport.poll(handle)
    return status, time.monotonic() - start


def test_registration_errors():
    """Bogus memory: mooncake's TCP path accepts it (segfault later); our adapter refuses it, naming the
    build that reads host memory only (the cpu extra's)."""
    buf = torch.zeros(64 * KIB, dtype=torch.uint8)
    with MooncakeTransport("127.0.0.1") as transport:
        assert transport.build.distribution == "mooncake-transfer-engine-non-cuda"
        assert not transport.reads_device_memory
        with pytest.raises(RegistrationError, match="not host memory, and mooncake-transfer-engine-non-cuda copies "
                                                    "from host memory only"):
            with transport.register(0x1000, 4096):
                pass
        with transport.register_tensor(buf) as region:
            with pytest.raises(RegistrationError, match="overlaps"):
                with transport.register(region.addr + KIB, KIB):
                    pass
    raw = _Engine("127.0.0.1", "tcp", "")
    try:
        raw.register(0x1000, 4096)  # documents mooncake's own behaviour: no check at all
        raw.unregister(0x1000)
        raw.register(buf.data_ptr(), buf.numel())
        with pytest.raises(RegistrationError, match="returned -7"):
            raw.register(buf.data_ptr() + KIB, KIB)
        with pytest.raises(TransferError, match="returned -3"):
            raw.unregister(buf.data_ptr() + 1)
    finally:
        raw.close()


def test_bandwidth_probe_over_tcp(peer):
    before = peer.snapshot()
    with sender(4 << 20, seed=2) as (transport, src, src_addr):
        result = measure_write_bandwidth(transport, peer.session_id, src_addr, peer.addr,
                                         num_bytes=4 << 20, op_bytes=256 * KIB, repeats=2)
        after = peer.snapshot()
    assert result.num_ops == 16 and result.bytes_per_s > 0
    ops = [WriteOp(src_addr + i * 256 * KIB, peer.addr + (15 - i) * 256 * KIB, 256 * KIB) for i in range(16)]
    assert torch.equal(after, expected(before, src, src_addr, peer, ops))


def test_concurrent_writers_share_one_transport(peer):
    """Four threads write disjoint ranges through one transport and poll concurrently."""
    before = peer.snapshot()
    with sender(4 << 20, seed=3) as (transport, src, src_addr):
        chunk = 1 << 20
        ops = [[WriteOp(src_addr + t * chunk + i * 64 * KIB, peer.addr + (3 - t) * chunk + i * 64 * KIB + 32 * KIB,
                        32 * KIB) for i in range(16)] for t in range(4)]
        errors: list[BaseException] = []

        def run(thread_ops):
            try:
                transport.wait(transport.write(peer.session_id, thread_ops), timeout_s=30)
            except BaseException as err:  # noqa: BLE001 - surfaced by the assert below
                errors.append(err)

        threads = [threading.Thread(target=run, args=(o,)) for o in ops]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        after = peer.snapshot()
    assert not errors
    assert torch.equal(after, expected(before, src, src_addr, peer, [op for o in ops for op in o]))


def _new_listeners(before: set[int]) -> list:
    return [lst for lst in listening_sockets(os.getpid()) if lst.inode not in before]


def test_engine_listens_only_on_its_configured_address(peer):
    """Mooncake 0.3 binds its RPC and TCP ports to every interface; the adapter makes them bind the
    configured 127.0.0.1 (and transfers over them still land: the module's peer is bound the same way)."""
    before = {lst.inode for lst in listening_sockets(os.getpid())}
    with sender(64 * KIB, seed=4) as (transport, src, src_addr):
        opened = _new_listeners(before)
        assert len(opened) == 2, [str(lst) for lst in opened]  # the handshake RPC port, the TCP acceptor
        assert all(lst.host == ipaddress.ip_address("127.0.0.1") for lst in opened), [str(lst) for lst in opened]
        assert transport.session_id == f"127.0.0.1:{transport._engine.rpc_port}"
        transport.wait(transport.write(peer.session_id, [WriteOp(src_addr, peer.addr, KIB)]), timeout_s=30)
        assert torch.equal(peer.snapshot()[:KIB], src[:KIB])
    assert _new_listeners(before) == [], "closing the transport must close its ports"


def test_a_port_left_on_every_interface_is_reported_at_start_up(monkeypatch, caplog):
    """Where the redirection cannot act (here: no library to patch), the engine's wildcard ports are
    named in a warning at start-up instead of passing silently."""
    monkeypatch.setattr(mooncake_adapter, "_loaded_libraries", lambda package_dir: [])
    before = {lst.inode for lst in listening_sockets(os.getpid())}
    with caplog.at_level(logging.WARNING, logger="tandem.transfer"):
        with MooncakeTransport("127.0.0.1"):
            wildcard = [lst for lst in _new_listeners(before) if not lst.is_loopback]
    assert len(wildcard) == 2, "mooncake no longer binds every interface: the redirection may be unneeded"
    warning = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "no authentication" in warning and "transport.hostname 127.0.0.1" in warning, warning
    assert all(f":{lst.port} " in warning for lst in wildcard), warning
