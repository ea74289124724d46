"""What one L3 value is: a fixed header that is verified on every read, then a page's KV bytes.

    offset  bytes  field
    0       4      magic b"TKV3"
    4       2      format version (1)                     little-endian
    6       2      reserved (0)
    8       16     namespace fingerprint (model + KVLayout, `KeyNamespace.fingerprint`)
    24      8      payload length in bytes (== KVLayout.page_bytes)
    32      16     BLAKE2b-128 of (page key, payload): a value copied under another key fails too
    48      ...    payload

Payload = the page's K then V in every layer, layer-first:

    [ K[0][page] | V[0][page] | K[1][page] | V[1][page] | ... ]    each [page_size, num_kv_heads, head_dim]

`pack_page` / `unpack_page` move one page between `KVCacheTensors` (CPU: L3 reads and writes host
pages) and those bytes. No I/O here.
"""

from __future__ import annotations

import enum
import hashlib
import struct
from dataclasses import dataclass

import torch

from kernels.kv_layout import KVCacheTensors

MAGIC = b"TKV3"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sHH16sQ16s")
HEADER_BYTES = _HEADER.size  # 48
CHECKSUM_BYTES = 16


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


def checksum(key: str, payload) -> bytes:
    h = hashlib.blake2b(digest_size=CHECKSUM_BYTES)
    h.update(key.encode())
    h.update(payload)
    return h.digest()


def encode_value(key: str, fingerprint: bytes, payload: bytes) -> bytes:
    """Header + payload for storing `payload` under `key`."""
    header = _HEADER.pack(MAGIC, FORMAT_VERSION, 0, fingerprint, len(payload), checksum(key, payload))
    return header + payload


def decode_value(key: str, fingerprint: bytes, page_bytes: int, value: bytes) -> Decoded:
    """Verify `value` read under `key`; the payload only when every check passes."""
    if len(value) < HEADER_BYTES:
        return Decoded(None, ValueFault.TRUNCATED)
    magic, version, _reserved, value_fp, length, digest = _HEADER.unpack_from(value)
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


def pack_page(kv: KVCacheTensors, page_id: int) -> bytes:
    """The payload of page `page_id` (layer-first, K then V). `kv` must be on the CPU."""
    _check_page(kv, page_id)
    per_tensor = kv.layout.page_bytes_per_tensor
    out = torch.empty(2 * kv.num_layers * per_tensor, dtype=torch.uint8)  # [page_bytes]
    for layer in range(kv.num_layers):
        base = 2 * layer * per_tensor
        out[base:base + per_tensor] = _page_bytes_view(kv.k[layer], page_id)
        out[base + per_tensor:base + 2 * per_tensor] = _page_bytes_view(kv.v[layer], page_id)
    return out.numpy().tobytes()


def unpack_page(kv: KVCacheTensors, page_id: int, payload) -> None:
    """Copy `payload` (from `pack_page` of the same layout) into page `page_id` of `kv`, in place."""
    _check_page(kv, page_id)
    per_tensor = kv.layout.page_bytes_per_tensor
    if len(payload) != 2 * kv.num_layers * per_tensor:
        raise ValueError(f"payload of {len(payload)} bytes for a page of {kv.layout.page_bytes} bytes: "
                         f"packed under another KV layout?")
    src = torch.frombuffer(bytearray(payload), dtype=torch.uint8)  # [page_bytes], owns a writable copy
    for layer in range(kv.num_layers):
        base = 2 * layer * per_tensor
        _page_bytes_view(kv.k[layer], page_id).copy_(src[base:base + per_tensor])
        _page_bytes_view(kv.v[layer], page_id).copy_(src[base + per_tensor:base + 2 * per_tensor])


def _page_bytes_view(tensor: torch.Tensor, page_id: int) -> torch.Tensor:
    """Page `page_id` of a `[num_pages, page_size, kvh, hd]` tensor as a flat uint8 view (no copy)."""
    return tensor[page_id].view(-1).view(torch.uint8)


def _check_page(kv: KVCacheTensors, page_id: int) -> None:
    if kv.k[0].device.type != "cpu":
        raise ValueError(f"L3 pages move through host memory; got tensors on {kv.k[0].device}")
    if not 0 <= page_id < kv.num_pages:
        raise IndexError(f"page {page_id} out of range: the pool has pages 0..{kv.num_pages - 1}")
