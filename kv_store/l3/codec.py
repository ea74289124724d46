"""What one L3 value is: a fixed header that is verified on every read, then a page's KV bytes.

    offset  bytes  field
    0       4      magic b"TKV3"
    4       2      format version (1)                     little-endian
    6       2      reserved (0)
    8       16     namespace fingerprint (model + KVLayout, `KeyNamespace.fingerprint`)
    24      8      payload length in bytes (== KVLayout.page_bytes)
    32      4      CRC-32 of (page key, payload): a value copied under another key fails too
    36      4      reserved (0)
    40      ...    payload

CRC-32 (zlib) rather than a cryptographic hash (BLAKE2b, several times slower: a large share of a
page's round trip; docs/results.md#kv-tiers): the check is against truncation, bit rot and
misplaced values, not an attacker, who could rewrite any checksum anyway (protect Redis with
AUTH/TLS and a private network).

Payload = the page's K then V in every layer, layer-first:

    [ K[0][page] | V[0][page] | K[1][page] | V[1][page] | ... ]    each [page_size, num_kv_heads, head_dim]

`PageBytes` moves one page between host `KVCacheTensors` (L3 reads and writes L2 pages) and those
bytes through byte views made once; `pack_page` / `unpack_page` are its one-shot forms. No I/O here.
"""

from __future__ import annotations

import enum
import struct
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from kernels.kv_layout import KVCacheTensors

MAGIC = b"TKV3"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sHH16sQII")
HEADER_BYTES = _HEADER.size  # 40


class ValueFault(enum.Enum):
    """Why a stored value was refused (each one is counted as corrupt and the key deleted)."""

    TRUNCATED = "truncated"  # shorter than the header, or than the payload length it declares
    BAD_MAGIC = "bad_magic"  # not a tandem L3 value
    BAD_VERSION = "bad_version"  # written by another format version
    WRONG_NAMESPACE = "wrong_namespace"  # another model or KV layout
    WRONG_LENGTH = "wrong_length"  # declared length differs from this layout's page bytes, or trailing bytes
    BAD_CHECKSUM = "bad_checksum"  # payload bytes changed (or value stored under another key)


@dataclass(frozen=True)
class Decoded:
    """`payload` when the value verified, else `fault` (exactly one is set)."""

    payload: bytes | None
    fault: ValueFault | None


def checksum(key: str, payload: bytes | memoryview) -> int:
    return zlib.crc32(payload, zlib.crc32(key.encode()))


def encode_value(key: str, fingerprint: bytes, payload: bytes) -> bytes:
    """Header + payload for storing `payload` under `key`."""
    header = _HEADER.pack(MAGIC, FORMAT_VERSION, 0, fingerprint, len(payload), checksum(key, payload), 0)
    return header + payload


def decode_value(key: str, fingerprint: bytes, page_bytes: int, value: bytes) -> Decoded:
    """Verify `value` read under `key`; the payload only when every check passes."""
    if len(value) < HEADER_BYTES:
        return Decoded(None, ValueFault.TRUNCATED)
    magic, version, _reserved, value_fp, length, digest, _reserved2 = _HEADER.unpack_from(value)
    if magic != MAGIC:
        return Decoded(None, ValueFault.BAD_MAGIC)
    if version != FORMAT_VERSION:
        return Decoded(None, ValueFault.BAD_VERSION)
    if value_fp != fingerprint:
        return Decoded(None, ValueFault.WRONG_NAMESPACE)
    if length != page_bytes:
        return Decoded(None, ValueFault.WRONG_LENGTH)
    if len(value) < HEADER_BYTES + length:
        return Decoded(None, ValueFault.TRUNCATED)
    if len(value) > HEADER_BYTES + length:
        return Decoded(None, ValueFault.WRONG_LENGTH)
    payload = memoryview(value)[HEADER_BYTES:]
    if checksum(key, payload) != digest:
        return Decoded(None, ValueFault.BAD_CHECKSUM)
    return Decoded(bytes(payload), None)


class PageBytes:
    """Byte views of one host `KVCacheTensors`, made once, to pack and unpack single pages.

    Shares memory with the tensors (no copy until `pack` / `unpack`); holds no state besides the views.
    Not locked: the caller owns the page it packs or unpacks (IN_FLIGHT under its handle).
    """

    def __init__(self, kv: KVCacheTensors):
        if kv.k[0].device.type != "cpu":
            raise ValueError(f"L3 pages move through host memory; got tensors on {kv.k[0].device}")
        if not all(t.is_contiguous() for t in kv.k + kv.v):
            raise ValueError("PageBytes needs contiguous KV tensors (as KVCacheTensors.allocate makes)")
        self.num_pages = kv.num_pages
        self.page_bytes = kv.layout.page_bytes
        # payload order: layer 0 K, layer 0 V, layer 1 K, ...; each [num_pages, page_bytes_per_tensor] uint8
        self._views = [t.view(t.shape[0], -1).view(torch.uint8).numpy() for pair in zip(kv.k, kv.v) for t in pair]

    def pack(self, page_id: int) -> bytes:
        """The payload of page `page_id` (layer-first, K then V)."""
        self._check(page_id)
        return b"".join([view[page_id] for view in self._views])

    def unpack(self, page_id: int, payload: bytes) -> None:
        """Copy `payload` (packed under the same layout) into page `page_id`, in place."""
        self._check(page_id)
        if len(payload) != self.page_bytes:
            raise ValueError(f"payload of {len(payload)} bytes for a page of {self.page_bytes} bytes: "
                             f"packed under another KV layout?")
        src = np.frombuffer(payload, dtype=np.uint8).reshape(len(self._views), -1)  # [2 * num_layers, per tensor]
        for view, row in zip(self._views, src):
            view[page_id] = row

    def _check(self, page_id: int) -> None:
        if not 0 <= page_id < self.num_pages:
            raise IndexError(f"page {page_id} out of range: the pool has pages 0..{self.num_pages - 1}")


def pack_page(kv: KVCacheTensors, page_id: int) -> bytes:
    """One-shot `PageBytes(kv).pack(page_id)`; keep a `PageBytes` to pack many pages."""
    return PageBytes(kv).pack(page_id)


def unpack_page(kv: KVCacheTensors, page_id: int, payload: bytes) -> None:
    """One-shot `PageBytes(kv).unpack(page_id, payload)`."""
    PageBytes(kv).unpack(page_id, payload)
