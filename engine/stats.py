"""The engine's counters as the heartbeat's frozen records (`common.protocol`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypedDict

from common.protocol import GraphStats, PoolStats, SpecStats, TierStats
from kv_store.page_pool import PagePool

if TYPE_CHECKING:
    from engine.graphs.runner import GraphCounters
    from engine.sessions import NullSessions, SessionManager
    from engine.spec.speculator import SpecCounters
    from kv_store.host_cache import HostCache, NullHostCache

BUSY_INTEGRITY_INTERVAL_S = 5.0
"""How often the heartbeat's integrity check runs while requests run: it walks every page of every
tier (with a large host tier on a CPU as long as a whole decode step, which every request waits
for), so not on every beat then. Debug mode (TANDEM_DEBUG_KV=1) still checks after every step."""


class IntegrityBeat:
    """The heartbeat's integrity verdict: the check runs on every beat while the engine is idle, and at
    most every `BUSY_INTEGRITY_INTERVAL_S` while it has work (its last verdict stands between). Holds no
    reference to the engine (a dropped engine must not be kept alive by a cycle)."""

    def __init__(self) -> None:
        self._checked_s, self._error = float("-inf"), ""

    def verdict(self, busy: bool, check: Callable[[], None]) -> str:
        """"" when `check` passed, else its failure (reported, not raised)."""
        now = time.monotonic()
        if not busy or now - self._checked_s >= BUSY_INTEGRITY_INTERVAL_S:
            self._checked_s = now
            try:
                check()
                self._error = ""
            except AssertionError as exc:
                self._error = str(exc) or "integrity check failed"
        return self._error


def pool_stats(pool: PagePool) -> PoolStats:
    u = pool.usage()
    return PoolStats(u.total, u.free, u.private, u.cached, u.in_flight)


def spec_stats(c: SpecCounters | None) -> SpecStats:
    """From a speculator's `SpecCounters` (None: speculation off)."""
    if c is None:
        return SpecStats()
    return SpecStats(c.verifies, tuple(sorted(c.accepted_per_verify.items())), tuple(sorted(c.drafted_at.items())),
                     tuple(sorted(c.accepted_at.items())), c.draft_errors)


def graph_stats(c: GraphCounters, compiling: bool = False) -> GraphStats:
    """From a graph runner's `GraphCounters` (and whether it still compiles)."""
    return GraphStats(c.replays, tuple(sorted((reason.value, n) for reason, n in c.fallbacks.items())), compiling,
                      c.computed_tokens)


class _L3Fields(TypedDict, total=False):
    """The `TierStats` fields of the L3 store (left at their defaults without one)."""

    l3: bool
    l3_get_pages: int
    l3_get_seconds: float
    l3_put_pages: int
    l3_put_seconds: float
    l3_errors: int
    l3_corrupt: int
    prefetches: tuple[tuple[str, int], ...]


def tier_stats(host_cache: HostCache | NullHostCache, hit_tokens_l1: int, sessions: SessionManager | NullSessions,
               page_size: int, transfer_corrupt: int = 0, transfer_verified_pages: int = 0) -> TierStats:
    c, l3 = host_cache.counters, host_cache.l3
    store = l3.store_stats()
    l3_fields: _L3Fields = {} if store is None else _L3Fields(
        l3=True, l3_get_pages=store.hits, l3_get_seconds=store.get_seconds, l3_put_pages=store.put_pages,
        l3_put_seconds=store.put_seconds, l3_errors=store.errors, l3_corrupt=store.corrupt,
        prefetches=tuple(sorted(l3.counters.prefetches.items())))
    return TierStats(page_size=page_size, hit_tokens_l1=hit_tokens_l1, hit_tokens_l2=c.l2_hit_tokens,
                     hit_tokens_l3=c.l3_hit_tokens, l1_to_l2_bytes=c.l1_to_l2_bytes,
                     l1_to_l2_seconds=c.l1_to_l2_seconds, l2_to_l1_bytes=c.l2_to_l1_bytes,
                     l2_to_l1_seconds=c.l2_to_l1_seconds, evicted_pages_l1=c.l1_evicted_pages,
                     evicted_pages_l2=c.l2_evicted_pages, copy_errors=c.copy_errors,
                     transfer_corrupt=transfer_corrupt, transfer_verified_pages=transfer_verified_pages,
                     l2_corrupt=c.l2_corrupt,
                     sessions_open=len(sessions.sessions), session_pages=sessions.pinned_pages(),
                     session_offloads=sessions.num_offloaded,
                     **l3_fields)
