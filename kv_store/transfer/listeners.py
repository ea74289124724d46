"""Which TCP ports a process listens on, and on which address (Linux `/proc`, no dependency).

Used to check, not to trust, that what tandem starts binds where it was told: the Mooncake engine
after `initialize`, the local Ray instance, and the tests that assert nothing listens beyond
loopback. A socket is matched to a process through the inode of its `/proc/<pid>/fd` link.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

_TCP_LISTEN = "0A"  # `st` column of /proc/net/tcp: TCP_LISTEN


@dataclass(frozen=True)
class Listener:
    """One listening TCP socket of process `pid`."""

    pid: int
    address: ipaddress.IPv4Address | ipaddress.IPv6Address
    port: int
    inode: int

    @property
    def host(self) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
        """The address, with an IPv4 address mapped into IPv6 (a dual-stack socket bound to
        ::ffff:127.0.0.1) given back as IPv4."""
        if isinstance(self.address, ipaddress.IPv6Address) and self.address.ipv4_mapped is not None:
            return self.address.ipv4_mapped
        return self.address

    @property
    def is_loopback(self) -> bool:
        """127.0.0.0/8 or ::1 (mapped or not); a wildcard (0.0.0.0, ::) is not."""
        return self.host.is_loopback

    def __str__(self) -> str:
        host = f"[{self.host}]" if self.host.version == 6 else str(self.host)
        return f"{host}:{self.port} (pid {self.pid}, {_process_name(self.pid)})"


def listening_sockets(pid: int) -> list[Listener]:
    """Every listening TCP socket `pid` holds open. Empty if the process is gone (it raced us)."""
    inodes = _socket_inodes(pid)
    if not inodes:
        return []
    found = []
    for table in ("tcp", "tcp6"):
        for address, port, inode in _listen_rows(Path(f"/proc/{pid}/net/{table}")):
            if inode in inodes:
                found.append(Listener(pid, address, port, inode))
    return found


def _socket_inodes(pid: int) -> set[int]:
    inodes: set[int] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed since the listing
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:["):-1]))
    return inodes


def _listen_rows(table: Path) -> Iterator[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int, int]]:
    """(address, port, inode) of each LISTEN row of a /proc/net/tcp{,6} table."""
    try:
        lines = table.read_text().splitlines()[1:]
    except (FileNotFoundError, ProcessLookupError):
        return
    for line in lines:
        fields = line.split()
        if fields[3] != _TCP_LISTEN:
            continue
        host_hex, port_hex = fields[1].split(":")
        yield _decode_address(host_hex), int(port_hex, 16), int(fields[9])


def _decode_address(host_hex: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """The kernel prints each 32-bit word of the address in host (little-endian) byte order."""
    raw = bytes.fromhex(host_hex)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def _process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "gone"
