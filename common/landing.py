"""Where a prompt's KV lands (bottom of the import graph: plain frozen dataclasses, no torch).

A `Landing` tells a prefill worker where its KV goes: the decode worker's transport session(s), the
landing pages reserved for the request, and the memory layout to compute byte addresses from.

A decode worker over tensor-parallel ranks lands on every rank: each rank's landing holds its own
KV heads (`LandingShard.heads`), in the same page ids (rank 0 reserves them for all). A prefill
rank writes the heads it holds to every shard holding any of them (`kv_store/transfer/heads.py`),
so KV moves rank pair by rank pair, never gathered through one rank.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVLayout:
    """Layer-first paged layout shared by device and host pools:
    per layer, K and V each `[num_pages, page_size, num_kv_heads, head_dim]`."""

    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # "float32" | "bfloat16" | "float16"
    element_bytes: int

    @property
    def page_bytes_per_tensor(self) -> int:
        """Bytes of one page in one layer's K (or V) tensor: the unit a page moves in."""
        return self.page_size * self.num_kv_heads * self.head_dim * self.element_bytes

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across all layers, K and V."""
        return 2 * self.num_layers * self.page_bytes_per_tensor

    def check_compatible(self, other: KVLayout) -> None:
        if self != other:
            raise ValueError(f"KV layouts differ (prefill and decode must run the same model, dtype and "
                             f"page size): {self} vs {other}")


@dataclass(frozen=True)
class LandingShard:
    """One decode rank's part of a landing: its transport session, its landing tensors' addresses
    (per layer, K and V), and the KV heads `[heads[0], heads[1])` of the model it holds."""

    session: str
    k_base: tuple[int, ...]
    v_base: tuple[int, ...]
    heads: tuple[int, int]


@dataclass(frozen=True)
class Landing:
    """Landing pages a decode worker reserved for one request's prompt KV.

    Page i holds prompt tokens `[i * page_size, (i + 1) * page_size)`; in a shard holding `n` heads
    its bytes in layer l start at `k_base[l] + page_ids[i] * page_size * n * head_dim * element_bytes`
    (same for V). `layout` is the whole model's (every KV head); a decode worker over ranks lists
    each rank's part in `shards` (then `session`, `k_base`, `v_base` are rank 0's).
    """

    request_id: str
    session: str  # the decode worker's transport session id
    page_ids: tuple[int, ...]
    k_base: tuple[int, ...]  # per layer, address of host K tensor
    v_base: tuple[int, ...]
    layout: KVLayout
    timeout_s: float  # the decode worker frees the landing this long after reserving it
    shards: tuple[LandingShard, ...] = ()  # a decode worker over ranks: each rank's part, rank 0 first

    def all_shards(self) -> tuple[LandingShard, ...]:
        """Every rank's part; a one-rank landing is one part holding every head."""
        return self.shards or (LandingShard(self.session, self.k_base, self.v_base, (0, self.layout.num_kv_heads)),)

    @property
    def sessions(self) -> tuple[str, ...]:
        return tuple(shard.session for shard in self.all_shards())
