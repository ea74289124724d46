"""Make a native library's wildcard `bind()` calls bind one address instead (Linux, 64-bit ELF).

Mooncake 0.3.x binds its handshake RPC socket to 0.0.0.0 and its TCP transport's acceptor to `::`
whatever hostname it is given, and offers no setting (MC_TCP_BIND_ADDRESS only names the address
it advertises); it has no authentication either. So, for the duration of `redirect_wildcard_binds`,
the `bind` entries of the named libraries' global offset tables point at a shim that rewrites a
wildcard address to the configured one and calls libc's `bind`:

    AF_INET  0.0.0.0  -> the IPv4 address
    AF_INET6 ::       -> the IPv6 address, or ::ffff:a.b.c.d for an IPv4 one (Mooncake's acceptor
                         is dual-stack, so it then accepts IPv4 connections to a.b.c.d only)

Anything else (a specific address, AF_UNIX, AF_INET with an IPv6 target) passes through unchanged.
Only calls made through those libraries' own PLT are affected, and only while the context is open:
the previous table entries are put back on exit. This is a best effort: the caller must check what
actually listens afterwards (`kv_store.transfer.listeners`) and warn when a wildcard remains.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import socket
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

_LOCK = threading.Lock()  # one redirection at a time: the GOT is process-wide
_RTLD_DI_LINKMAP = 2
_SHT_RELA = 4
_ELF64_RELA_SIZE = 24
_ELF64_SYM_SIZE = 24
_BIND = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_uint32, use_errno=True)


class _LinkMap(ctypes.Structure):
    _fields_ = [("l_addr", ctypes.c_size_t)]  # the load bias; the struct's first field


def resolve_bind_address(hostname: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """The address a hostname binds: itself if it is one, else its first IPv4 (then IPv6) address."""
    try:
        return ipaddress.ip_address(hostname)
    except ValueError:
        pass
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            infos = socket.getaddrinfo(hostname, None, family, socket.SOCK_STREAM)
        except socket.gaierror:
            continue
        if infos:
            return ipaddress.ip_address(infos[0][4][0])
    raise OSError(f"cannot resolve {hostname!r} to an address to bind")


@contextlib.contextmanager
def redirect_wildcard_binds(address: ipaddress.IPv4Address | ipaddress.IPv6Address,
                            libraries: Sequence[Path]) -> Iterator[int]:
    """Within the block, wildcard binds made by `libraries` (already loaded) bind `address`.

    Yields how many table entries were redirected (0: nothing could be, e.g. not an ELF64 x86-64/
    aarch64 Linux library, or a read-only table); the caller decides whether to warn.
    """
    if address.is_unspecified:  # configured to listen everywhere: nothing to redirect
        yield 0
        return
    libc = ctypes.CDLL(None, use_errno=True)
    real_bind = libc.bind
    real_bind.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint32]
    real_bind.restype = ctypes.c_int
    rewrite = _rewriter(address)

    def shim(fd: int, sockaddr: int, length: int) -> int:
        raw = ctypes.string_at(sockaddr, length)
        fixed = rewrite(raw)
        if fixed is raw:
            return real_bind(fd, sockaddr, length)
        return real_bind(fd, ctypes.create_string_buffer(fixed, length), length)

    callback = _BIND(shim)  # must outlive every call through the patched entries
    target = ctypes.cast(callback, ctypes.c_void_p).value
    with _LOCK:
        saved = []
        try:
            for library in libraries:
                for slot in _writable_slots(library, "bind", libc):
                    saved.append((slot, slot.value))
                    slot.value = target
            yield len(saved)
        finally:
            for slot, value in reversed(saved):
                slot.value = value


def _rewriter(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> Callable[[bytes], bytes]:
    """sockaddr bytes -> the same bytes, or new ones with the wildcard replaced by `address`.

    sockaddr_in: family u16 | port u16 | addr[4] | zero[8];  sockaddr_in6: family | port | flowinfo u32 |
    addr[16] | scope u32.
    """
    v6 = address.packed if address.version == 6 else ipaddress.IPv6Address(f"::ffff:{address}").packed
    v4 = address.packed if address.version == 4 else None

    def rewrite(raw: bytes) -> bytes:
        family = struct.unpack_from("=H", raw, 0)[0] if len(raw) >= 2 else None
        if family == socket.AF_INET and v4 is not None and len(raw) >= 8 and raw[4:8] == bytes(4):
            return raw[:4] + v4 + raw[8:]
        if family == socket.AF_INET6 and len(raw) >= 24 and raw[8:24] == bytes(16):
            return raw[:8] + v6 + raw[24:]
        return raw

    return rewrite


def _writable_slots(library: Path, symbol: str, libc: ctypes.CDLL) -> list[ctypes.c_void_p]:
    """The loaded `library`'s GOT entries for `symbol` that sit in writable memory."""
    try:
        offsets = _relocation_offsets(library.read_bytes(), symbol)
    except (OSError, ValueError, struct.error):
        return []
    if not offsets:
        return []
    handle = ctypes.CDLL(str(library))  # already loaded: the same link map, one more reference
    link_map = ctypes.POINTER(_LinkMap)()
    if libc.dlinfo(ctypes.c_void_p(handle._handle), _RTLD_DI_LINKMAP, ctypes.byref(link_map)) != 0:
        return []
    base = link_map.contents.l_addr
    writable = _writable_ranges()
    return [ctypes.c_void_p.from_address(base + offset) for offset in offsets
            if any(lo <= base + offset < hi for lo, hi in writable)]


def _relocation_offsets(elf: bytes, symbol: str) -> list[int]:
    """r_offset of every RELA relocation naming `symbol` (ELF64 little-endian, from section headers)."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF")
    shoff = struct.unpack_from("<Q", elf, 0x28)[0]
    shentsize, shnum = struct.unpack_from("<HH", elf, 0x3A)
    # (sh_type, sh_offset, sh_size, sh_link) of each section header
    sections = [struct.unpack_from("<4xI16xQQI", elf, shoff + i * shentsize) for i in range(shnum)]
    wanted = symbol.encode()
    offsets = []
    for sh_type, rela_off, rela_size, symtab_index in sections:
        if sh_type != _SHT_RELA or symtab_index >= shnum:
            continue
        _, symtab_off, _, strtab_index = sections[symtab_index]
        strtab_off = sections[strtab_index][1]
        for k in range(rela_size // _ELF64_RELA_SIZE):
            r_offset, r_info = struct.unpack_from("<QQ", elf, rela_off + k * _ELF64_RELA_SIZE)
            sym_index = r_info >> 32
            if sym_index == 0:
                continue
            name_off = strtab_off + struct.unpack_from("<I", elf, symtab_off + sym_index * _ELF64_SYM_SIZE)[0]
            if elf[name_off:elf.index(b"\0", name_off)] == wanted:
                offsets.append(r_offset)
    return offsets


def _writable_ranges() -> list[tuple[int, int]]:
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, perms = line.split()[:2]
        if perms[1] == "w":
            lo, hi = span.split("-")
            ranges.append((int(lo, 16), int(hi, 16)))
    return ranges
