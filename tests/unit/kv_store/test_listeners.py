"""`kv_store.transfer.listeners` and `bind_redirect` on sockets this test opens itself."""

from __future__ import annotations

import ipaddress
import os
import socket

import pytest

from kv_store.transfer.bind_redirect import _rewriter, resolve_bind_address
from kv_store.transfer.listeners import listening_sockets


def ours(sock: socket.socket):
    port = sock.getsockname()[1]
    return [lst for lst in listening_sockets(os.getpid()) if lst.port == port]


def listen(family: int, host: str, v6only: bool | None = None) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    if v6only is not None:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, int(v6only))
    sock.bind((host, 0))
    sock.listen()
    return sock


def test_loopback_wildcard_and_mapped_listeners_are_told_apart():
    with listen(socket.AF_INET, "127.0.0.1") as loop, listen(socket.AF_INET, "0.0.0.0") as anywhere:
        [a], [b] = ours(loop), ours(anywhere)
        assert (a.host, a.is_loopback) == (ipaddress.ip_address("127.0.0.1"), True)
        assert (b.host, b.is_loopback) == (ipaddress.ip_address("0.0.0.0"), False)
        assert f":{loop.getsockname()[1]} (pid {os.getpid()}" in str(a)
    if not socket.has_ipv6:
        return
    try:
        mapped = listen(socket.AF_INET6, "::ffff:127.0.0.1", v6only=False)
        dual = listen(socket.AF_INET6, "::", v6only=False)
    except OSError as err:  # a kernel without IPv6
        pytest.skip(f"no IPv6: {err}")
    with mapped, dual:
        [m], [d] = ours(mapped), ours(dual)
        assert m.address == ipaddress.ip_address("::ffff:127.0.0.1") and m.is_loopback
        assert d.address == ipaddress.ip_address("::") and not d.is_loopback


def test_a_closed_or_foreign_socket_is_not_listed():
    sock = listen(socket.AF_INET, "127.0.0.1")
    port = sock.getsockname()[1]
    sock.close()
    assert [lst for lst in listening_sockets(os.getpid()) if lst.port == port] == []
    assert listening_sockets(2**22 + 1) == []  # above pid_max's default: no such process


def test_wildcard_binds_are_rewritten_to_the_configured_address():
    port = (8000).to_bytes(2, "big")
    any4 = socket.AF_INET.to_bytes(2, "little") + port + bytes(4) + bytes(8)
    any6 = socket.AF_INET6.to_bytes(2, "little") + port + bytes(4) + bytes(16) + bytes(4)
    to_v4 = _rewriter(ipaddress.ip_address("127.0.0.1"))
    assert to_v4(any4)[4:8] == bytes([127, 0, 0, 1])
    assert to_v4(any6)[8:24] == ipaddress.ip_address("::ffff:127.0.0.1").packed  # dual-stack: IPv4 only
    specific = any4[:4] + bytes([10, 0, 0, 7]) + any4[8:]
    assert to_v4(specific) is specific
    to_v6 = _rewriter(ipaddress.ip_address("::1"))
    assert to_v6(any6)[8:24] == ipaddress.ip_address("::1").packed
    assert to_v6(any4) is any4  # an IPv4 socket cannot take an IPv6 address: left alone (and reported)
    assert resolve_bind_address("127.0.0.1") == ipaddress.ip_address("127.0.0.1")
    assert resolve_bind_address("localhost").is_loopback
