"""Which bytes of a request's KV pages a prefill rank writes into which decode rank's landing
(docs/design.md §7, "Across tensor-parallel degrees").

Pages are `[page_size, heads, head_dim]` per layer, K and V, in every pool; a rank's pool holds its
own heads. A prefill rank writes the heads it sends (`sent_heads`: those it holds that no lower
rank holds, so a head several ranks share is written once) into every landing shard holding any of
them. Where the two sides hold the same heads a page is one contiguous op; otherwise each token's
run of shared heads is one op (`coalesce` merges what is adjacent on both sides).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.landing import Landing
from kv_store.transfer.base import WriteOp, coalesce

if TYPE_CHECKING:
    from kernels.kv_layout import KVCacheTensors


def sent_heads(held: Sequence[range], rank: int) -> range:
    """The KV heads rank `rank` writes, of `held` (each rank's heads, contiguous and in rank order):
    its own, less those a lower rank holds too."""
    below = max((heads.stop for heads in held[:rank]), default=0)
    mine = held[rank]
    return range(max(mine.start, below), max(mine.stop, below))


@dataclass(frozen=True)
class SourceKV:
    """A rank's KV as its writes read it: per layer the K and V tensors' addresses, the heads its
    pages hold (`held`) and those it writes (`sent`)."""

    k_base: tuple[int, ...]
    v_base: tuple[int, ...]
    held: range
    sent: range

    @classmethod
    def of(cls, kv_cache: KVCacheTensors, held: range | None = None, sent: range | None = None) -> SourceKV:
        """`kv_cache`'s; `held`/`sent` default to every head it holds."""
        heads = range(kv_cache.k[0].shape[2]) if held is None else held
        return cls(tuple(t.data_ptr() for t in kv_cache.k), tuple(t.data_ptr() for t in kv_cache.v), heads,
                   heads if sent is None else sent)


def head_ops(source: SourceKV, src_pages: Sequence[int], landing: Landing, start: int) -> dict[str, list[WriteOp]]:
    """Per landing session, the ops writing `source`'s pages `src_pages` (the request's pages
    `[start, start + len(src_pages))`) into its landing pages: the heads `source` sends that the
    shard holds. Sessions that get nothing are left out."""
    layout = landing.layout
    head_bytes, page_size = layout.head_dim * layout.element_bytes, layout.page_size
    src_row = len(source.held) * head_bytes  # one token's heads
    out: dict[str, list[WriteOp]] = {}
    for shard in landing.all_shards():
        first, stop = max(source.sent.start, shard.heads[0]), min(source.sent.stop, shard.heads[1])
        if first >= stop:
            continue
        dst_row, width = (shard.heads[1] - shard.heads[0]) * head_bytes, (stop - first) * head_bytes
        src_off, dst_off = (first - source.held.start) * head_bytes, (first - shard.heads[0]) * head_bytes
        rows = [(0, page_size * width)] if width == src_row == dst_row else [(t, width) for t in range(page_size)]
        ops: list[WriteOp] = []
        for bases in zip(source.k_base, shard.k_base, source.v_base, shard.v_base):
            for src_base, dst_base in (bases[:2], bases[2:]):
                for j, page in enumerate(src_pages):
                    src = src_base + page * page_size * src_row + src_off
                    dst = dst_base + landing.page_ids[start + j] * page_size * dst_row + dst_off
                    ops.extend(WriteOp(src + t * src_row, dst + t * dst_row, n) for t, n in rows)
        out[shard.session] = coalesce(ops)
    return out
