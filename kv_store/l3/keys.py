"""Page keys of the L3 store: a hash chain over whole pages of token ids.

    key(page 0) = H(namespace, ROOT,          tokens[0 : P])
    key(page i) = H(namespace, key(page i-1), tokens[i*P : (i+1)*P])        P = page size

`namespace` = the model id and every `KVLayout` field (layers, page size, KV heads, head dim, dtype,
element bytes), so KV of another model, dtype or page size can never be found under the same key, and
a page's key names its whole prefix, so equal keys mean equal KV (a page's KV depends on every token
before it). A trailing partial page has no key. The encoding is fixed here, byte by byte
(length-prefixed UTF-8, little-endian int64 tokens, BLAKE2b-256), so every process and machine
computes the same keys; changing it changes `KEY_FORMAT` and orphans what older versions wrote.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from common.protocol import KVLayout

KEY_FORMAT = b"tandem-l3-page-key/v1"
DIGEST_BYTES = 32
ROOT_KEY = "00" * DIGEST_BYTES
"""The parent of page 0: no real key equals it (that would need a BLAKE2b preimage)."""
FINGERPRINT_BYTES = 16


@dataclass(frozen=True)
class KeyNamespace:
    """What KV bytes depend on besides the tokens: the model and the exact KV layout."""

    model: str
    """A stable model id (a name plus its weights' revision or checksum, not a local path that
    differs between machines)."""
    layout: KVLayout

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty string, got {self.model!r}")

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    def encode(self) -> bytes:
        """The canonical bytes of this namespace: the model id, then every layout field by name."""
        out = [KEY_FORMAT, _field(b"model", self.model.encode())]
        for f in dataclasses.fields(KVLayout):
            out.append(_field(f.name.encode(), str(getattr(self.layout, f.name)).encode()))
        return b"".join(out)

    def fingerprint(self) -> bytes:
        """16 bytes naming this namespace; every stored value's header carries it."""
        return hashlib.blake2b(self.encode(), digest_size=FINGERPRINT_BYTES).digest()


def page_key(namespace_bytes: bytes, parent_key: str, page_tokens: Sequence[int]) -> str:
    """The key (64 hex digits) of one page of tokens whose prefix ends at `parent_key`."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    h.update(namespace_bytes)
    h.update(bytes.fromhex(parent_key))
    h.update(struct.pack(f"<{len(page_tokens)}q", *page_tokens))
    return h.hexdigest()


def page_keys(namespace: KeyNamespace, token_ids: Sequence[int], parent_key: str = ROOT_KEY) -> list[str]:
    """Keys of each whole page of `token_ids`, continuing the chain after `parent_key`.

    `token_ids[0]` must be the first token of a page: with the default `ROOT_KEY` the sequence starts
    at position 0; with the key of page j it starts at position (j + 1) * page_size (so a session can
    extend its chain without rehashing its history). Tokens past the last whole page are ignored.
    """
    if len(parent_key) != 2 * DIGEST_BYTES:
        raise ValueError(f"parent_key must be {2 * DIGEST_BYTES} hex digits, got {parent_key!r}")
    ps = namespace.page_size
    ns = namespace.encode()
    keys, parent = [], parent_key
    for start in range(0, len(token_ids) // ps * ps, ps):
        parent = page_key(ns, parent, token_ids[start:start + ps])
        keys.append(parent)
    return keys


def _field(name: bytes, value: bytes) -> bytes:
    return struct.pack("<I", len(name)) + name + struct.pack("<I", len(value)) + value
