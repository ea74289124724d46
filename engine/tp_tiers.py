"""The KV tiers below the device pool under tensor parallelism (docs/design.md §9): a host tier (L2)
and an L3 part on every rank, each for that rank's KV heads, every decision rank 0's.

    rank 0                                          the other ranks (`RankTiers`)
    its tier's copier sends each copy first         "tier_copy": the same pages, their own host tier
      (`LeadCopier`)
    its L3 sends each put first (`LeadL3.put`)      "l3_put": the same keys, their own host pages
    a finished fetch asks what arrived              "l3_fetch": the same keys into the same host
      (`LeadL3.arrived`): the fewest pages any        pages, read now; answers how many arrived
      rank got are the pages that arrived

Every rank files the same page keys under a key prefix of its own (its heads: `rank_l3`), so the
ranks' parts of a page never meet, nor meet a deployment at another degree. A rank runs each call
before its next, so its host pages hold what rank 0's do whenever rank 0 next reads them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kv_store.copier import Copier, CopyJob, Direction
from kv_store.l3.config import L3Config

if TYPE_CHECKING:
    from engine.tp import ControlGroup
    from kernels.kv_layout import KVCacheTensors
    from kernels.model.tp import Shard
    from kv_store.l3.tier import L3, L3Tier, Prefetch

TIER_COPY_TIMEOUT_S = 60.0
"""The longest a rank waits for one of its host tier's copies; past it (or on a failed copy) the rank
stops, and rank 0's next collective fails (a rank whose pages may differ from rank 0's must not go on)."""


def rank_l3(l3: L3Config, shard: Shard) -> L3Config:
    """`l3` with the key prefix of `shard`'s part of every page."""
    heads = shard.kv_heads
    return dataclasses.replace(l3, key_prefix=f"{l3.key_prefix}tp{shard.size}h{heads.start}-{heads.stop}:")


class LeadCopier:
    """Rank 0's host tier copier (`kv_store.copier.PageCopier`): each copy between device and host
    pages is sent to the other ranks first, which make it between their own pages and host tier
    before running their next call, so in the order rank 0 issued it and before any forward that
    reads or rewrites those pages; then it is rank 0's (its job, which rank 0's tier waits on)."""

    def __init__(self, copier: Copier, control: ControlGroup) -> None:
        self._copier, self._control = copier, control

    def submit(self, direction: Direction, src_pages: list[int], dst_pages: list[int]) -> CopyJob:
        self._control.send(("tier_copy", direction, list(src_pages), list(dst_pages)))
        return self._copier.submit(direction, src_pages, dst_pages)

    def __getattr__(self, name: str) -> Any:  # the wrapped copier's
        return getattr(self._copier, name)


class LeadL3:
    """Rank 0's L3 (`kv_store.l3.tier.L3Tier`) as its bridge sees it: puts sent to the other ranks
    first; a fetch's pages are those every rank got (module docstring)."""

    def __init__(self, tier: L3, control: ControlGroup) -> None:
        self._tier, self._control = tier, control

    def put(self, keys: list[str], host_pages: list[int]) -> None:
        self._control.send(("l3_put", list(keys), list(host_pages)))
        self._tier.put(keys, host_pages)

    def arrived(self, prefetch: Prefetch) -> int:
        n = self._tier.arrived(prefetch)
        if n == 0:
            return 0
        self._control.send(("l3_fetch", prefetch.keys[:n], prefetch.host_pages[:n]))
        answers = self._control.gather(None)
        assert answers is not None, "rank 0's gather came back empty: LeadL3 on a rank other than 0?"
        return min([n, *(got for got in answers[1:])])

    def __getattr__(self, name: str) -> Any:  # the wrapped tier's
        return getattr(self._tier, name)


class RankTiers:
    """A rank's host tier and L3 part, and the calls that keep them as rank 0's (module docstring)."""

    def __init__(self, kv: KVCacheTensors, num_pages: int, l3: tuple[L3Config, str] | None, shard: Shard,
                 control: ControlGroup, closing: contextlib.ExitStack) -> None:
        """`l3`: (rank 0's `L3Config`, its model id) or None; `shard`: this rank's `Shard`."""
        from kv_store.copier import PageCopier
        from kv_store.tier_copies import host_tensors

        self.host = host_tensors(kv, num_pages)
        self.copier = PageCopier(kv, self.host, name="tier-copier")
        closing.callback(self.copier.close)
        self.control = control
        self.l3: L3Tier | None = None
        if l3 is not None:
            from kv_store.l3.keys import KeyNamespace
            from kv_store.l3.redis_store import RedisPageStore
            from kv_store.l3.tier import L3Tier

            config, model_id = l3
            config = rank_l3(config, shard)
            namespace = KeyNamespace(model_id, kv.layout)
            self.l3 = L3Tier(RedisPageStore(config, namespace), namespace, self.host, config)
            closing.callback(self.l3.close)

    def calls(self) -> dict[str, Callable[..., None]]:
        calls: dict[str, Callable[..., None]] = {"tier_copy": self.copy}
        if self.l3 is not None:
            calls.update(l3_put=self.l3.put, l3_fetch=self.fetch)
        return calls

    def copy(self, direction: Direction, src_pages: list[int], dst_pages: list[int]) -> None:
        job = self.copier.submit(direction, src_pages, dst_pages)
        if not job.wait(TIER_COPY_TIMEOUT_S) or job.error is not None:
            raise RuntimeError(f"host tier copy {direction.name} failed on this rank: {job.error!r}")

    def fetch(self, keys: list[str], host_pages: list[int]) -> None:
        """Read `keys` into `host_pages` now; answer how many leading pages arrived."""
        assert self.l3 is not None, "l3_fetch on a rank without L3: `calls` offers it only with one"
        self.control.gather(self.l3.read_now(keys, host_pages))
