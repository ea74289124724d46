"""The token relay (`common/relay.py`): a worker host's messages reach the gateway's sink in order
over a real loopback connection; a wrong secret, an unknown worker, an oversized or missing hello
are closed before anything is unpickled; a failed send puts the messages back on the long-poll."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time

import pytest

from cluster.worker_host.thread import QueueConn
from common import protocol as p
from common import relay


class _Gateway:
    """A RelayServer on its own event loop thread, accepting worker `w#0` into `self.got`."""

    def __init__(self, known: str = "w#0"):
        self.secret, self.known = relay.new_secret(), known
        self.got: list = []
        self.closed: list[str] = []
        self.accepts: list[str] = []
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.server = relay.RelayServer("127.0.0.1", self.secret, self._accept)
        self.port = asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(10)

    def _accept(self, peer_id: str):
        self.accepts.append(peer_id)
        if peer_id != self.known:
            return None
        return self.got.extend, self.closed.append

    def hello(self, peer_id: str = "w#0") -> bytes:
        return relay.hello(self.secret, peer_id)

    def wait_for(self, n: int, timeout_s: float = 10) -> list:
        deadline = time.monotonic() + timeout_s
        while len(self.got) < n:
            assert time.monotonic() < deadline, f"only {len(self.got)} of {n} messages arrived"
            time.sleep(0.01)
        return self.got

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture
def gateway():
    gw = _Gateway()
    yield gw
    gw.close()


def _tokens(request_id: str, *ids: int) -> p.TokenOutput:
    return p.TokenOutput(request_id, tuple(ids), None, "")


def test_a_hosts_messages_reach_the_sink_in_order_and_heartbeats_and_crashes_stay_off_it(gateway):
    conn = QueueConn()
    conn.relay_to(p.RelayTo("127.0.0.1", gateway.port, gateway.hello()))
    sent = [_tokens("a", i) for i in range(50)]
    for i in range(0, 50, 5):
        conn.send_many(sent[i:i + 5])  # a step's messages: one frame
    conn.send(p.Heartbeat(None))
    crash = p.WorkerCrashed(p.WorkerRole.DECODE, "boom")
    conn.send(crash)
    assert gateway.wait_for(50) == sent
    assert conn.collect(0.0) == [crash]  # the crash report goes where the loop's end is seen
    conn.close()
    deadline = time.monotonic() + 10
    while not gateway.closed:
        assert time.monotonic() < deadline, "the worker closing its end never reached the sink"
        time.sleep(0.01)
    assert gateway.accepts == ["w#0"]


def test_a_failed_send_puts_that_batch_and_every_later_one_on_the_long_poll(gateway, monkeypatch):
    conn = QueueConn()
    conn.relay_to(p.RelayTo("127.0.0.1", gateway.port, gateway.hello()))
    conn.send_many([_tokens("a", 1)])
    gateway.wait_for(1)

    def fail(msgs):
        raise ConnectionResetError("peer gone")

    monkeypatch.setattr(conn._relay, "send", fail)
    later = [_tokens("a", 2), _tokens("a", 3)]
    conn.send_many(later[:1])
    conn.send_many(later[1:])
    assert conn.collect(0.0) == later and gateway.got == [_tokens("a", 1)]
    assert conn._relay is None


def test_an_unreachable_gateway_leaves_the_long_poll_in_place():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    conn = QueueConn()
    conn.relay_to(p.RelayTo("127.0.0.1", port, b"x" * relay.SECRET_BYTES))
    conn.send_many([_tokens("a", 1)])
    assert conn.collect(0.0) == [_tokens("a", 1)]


def _raw(port: int, *frames: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    for frame in frames:
        sock.sendall(struct.pack("!I", len(frame)) + frame)
    return sock


def _closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.mark.parametrize("case", ["wrong secret", "unknown worker", "oversized hello"])
def test_a_bad_hello_is_closed_before_anything_is_unpickled(gateway, case):
    not_a_pickle = b"\x80\x05 this would raise if unpickled"
    first = {"wrong secret": relay.hello(relay.new_secret(), "w#0"),
             "unknown worker": gateway.hello("w#1"),
             "oversized hello": gateway.hello("w#0" + "x" * relay.MAX_HELLO_BYTES)}[case]
    with _raw(gateway.port, first, not_a_pickle) as sock:
        assert _closed_by_server(sock)
    assert gateway.got == [] and gateway.closed == []
    assert gateway.accepts == ({"wrong secret": [], "unknown worker": ["w#1"], "oversized hello": []}[case])


def test_a_connection_without_a_hello_is_closed_after_the_timeout(gateway, monkeypatch):
    monkeypatch.setattr(relay, "HELLO_TIMEOUT_S", 0.2)
    with _raw(gateway.port) as sock:
        start = time.monotonic()
        assert _closed_by_server(sock)
        assert time.monotonic() - start < 5
    assert gateway.accepts == []
