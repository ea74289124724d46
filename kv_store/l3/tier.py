"""L3 under the host tier (DESIGN §5): page writes to the shared store and prefetches into L2.

Everything that talks to the store runs on two background threads (one for writes, one for reads),
so a slow or dead Redis never stalls a scheduler step; the scheduler's thread only packs payloads
and hands out host pages. Every store fault is a counted miss (`RedisPageStore` never raises for
one): a write that fails is a page L3 lacks, a read that fails brings fewer pages.

A prefetch runs in two phases, so host pages are taken only for pages L3 has:

    LOOKUP   match_len of the keys past the local (L1/L2) match, on the read thread
    FETCH    (when L3 extends the match by >= prefetch_min_pages) the scheduler lends host pages to
             the prefetch (IN_FLIGHT); the read thread gets, verifies and unpacks them
    DONE     the scheduler attaches the pages that arrived to the tree as host-only nodes

The tree's side of all this is `kv_store/l3/bridge.py`.
"""

from __future__ import annotations

import enum
import itertools
import logging
import queue
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kernels.kv_layout import KVCacheTensors
from kv_store.l3.codec import PageBytes
from kv_store.l3.config import L3Config
from kv_store.l3.keys import ROOT_KEY, KeyNamespace, page_keys
from kv_store.l3.redis_store import L3Stats, RedisPageStore

log = logging.getLogger(__name__)


class PrefetchPhase(enum.Enum):
    LOOKUP = "lookup"
    FETCH = "fetch"
    DONE = "done"


_PREFETCH_MOVES = {PrefetchPhase.LOOKUP: {PrefetchPhase.FETCH, PrefetchPhase.DONE},
                   PrefetchPhase.FETCH: {PrefetchPhase.DONE}, PrefetchPhase.DONE: set()}


@dataclass(eq=False)
class Prefetch:
    """L3 -> L2 for `keys` (pages `first_page ..` of `token_ids`). Fields below the line are written
    by the read thread before it sets `_done`, and read by the scheduler only after."""

    id: int
    token_ids: tuple[int, ...]
    first_page: int  # the local match, in pages, when the prefetch began
    keys: list[str]
    deadline: float  # monotonic; the "timeout" policy's
    phase: PrefetchPhase = PrefetchPhase.LOOKUP
    host_pages: list[int] = field(default_factory=list)  # lent to the prefetch in FETCH
    outcome: str = ""  # "" while running; completed | partial | short | no_room | failed
    # ---- written by the read thread
    num_found: int = 0  # LOOKUP: pages L3 has; FETCH: pages that arrived and were unpacked
    error: str = ""
    _done: threading.Event = field(default_factory=threading.Event, repr=False)

    def __hash__(self) -> int:
        return hash(("prefetch", self.id))

    def step_done(self) -> bool:
        """Whether the read thread finished the current phase (never blocks)."""
        return self._done.is_set()

    def wait(self, timeout_s: float) -> bool:
        return self._done.wait(timeout_s)

    def move(self, dst: PrefetchPhase) -> None:
        if dst not in _PREFETCH_MOVES[self.phase]:
            raise RuntimeError(f"prefetch {self.id}: {self.phase.value} -> {dst.value} is not a legal move")
        self.phase = dst
        self._done.clear()


@dataclass
class L3Counters:
    hit_tokens: int = 0  # tokens attached to the tree from L3
    prefetches: dict = field(default_factory=dict)  # outcome -> count


_STOP = object()


class L3(Protocol):
    """What `L3Bridge` calls: an `L3Tier`, or one that sends its puts and fetches on to the other ranks
    of a tensor-parallel engine (`engine.tp_tiers.LeadL3`)."""

    config: L3Config
    counters: L3Counters

    def keys(self, token_ids: Sequence[int], parent_key: str = ROOT_KEY) -> list[str]: ...

    def put(self, keys: list[str], host_pages: list[int]) -> None: ...

    def start_prefetch(self, token_ids: Sequence[int], first_page: int, keys: list[str]) -> Prefetch: ...

    def fetch(self, prefetch: Prefetch, host_pages: list[int]) -> None: ...

    def flush(self, timeout_s: float) -> bool: ...

    def arrived(self, prefetch: Prefetch) -> int: ...

    def count(self, outcome: str) -> None: ...

    def stats(self) -> L3Stats: ...

    def close(self) -> None: ...


class L3Tier:
    """The store plus its two threads; owned by one `HostCache`."""

    def __init__(self, store: RedisPageStore, namespace: KeyNamespace, host_kv: KVCacheTensors, config: L3Config):
        self.store, self.namespace, self.config = store, namespace, config
        self.page_size = namespace.page_size
        self._ns_bytes = namespace.encode()
        self._bytes = PageBytes(host_kv)
        self.counters = L3Counters()
        self._ids = itertools.count(1)
        self._reads: queue.Queue = queue.Queue()
        self._writes: queue.Queue = queue.Queue()
        # The threads hold only a weak reference: a tier dropped without close() is freed, and the
        # finalizer stops them.
        me = weakref.ref(self)
        self._threads = [threading.Thread(target=_serve, args=(q, me, fn), name=f"kv-l3-{fn}", daemon=True)
                         for q, fn in ((self._reads, "_read"), (self._writes, "_write"))]
        for t in self._threads:
            t.start()
        weakref.finalize(self, _stop_all, (self._reads, self._writes))

    def keys(self, token_ids: Sequence[int], parent_key: str = ROOT_KEY) -> list[str]:
        """Keys of the whole pages of `token_ids`, chained after `parent_key` (ROOT_KEY: from position 0)."""
        return page_keys(self.namespace, token_ids, parent_key)

    def put(self, keys: list[str], host_pages: list[int]) -> None:
        """Write these host pages (packed now, on the caller's thread) to L3 if it lacks them."""
        payloads = [self._bytes.pack(p) for p in host_pages]
        self._writes.put((list(keys), payloads))

    def start_prefetch(self, token_ids: Sequence[int], first_page: int, keys: list[str]) -> Prefetch:
        config = self.config
        deadline = time.monotonic() + config.prefetch_timeout_s + config.prefetch_timeout_per_page_s * len(keys)
        prefetch = Prefetch(next(self._ids), tuple(token_ids), first_page, keys, deadline)
        self._reads.put(prefetch)
        return prefetch

    def fetch(self, prefetch: Prefetch, host_pages: list[int]) -> None:
        """Phase 2: `host_pages` (lent to `prefetch`) receive the first `len(host_pages)` pages."""
        prefetch.host_pages = list(host_pages)
        prefetch.move(PrefetchPhase.FETCH)
        self._reads.put(prefetch)

    def flush(self, timeout_s: float) -> bool:
        """Wait until every write handed to `put` so far has been sent (or failed); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self._writes.unfinished_tasks:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return True

    def arrived(self, prefetch: Prefetch) -> int:
        """How many leading pages of a finished fetch arrived (a tensor-parallel rank 0's asks every rank)."""
        return prefetch.num_found

    def count(self, outcome: str) -> None:
        self.counters.prefetches[outcome] = self.counters.prefetches.get(outcome, 0) + 1

    def stats(self) -> L3Stats:
        return self.store.stats()

    def close(self) -> None:
        for q in (self._reads, self._writes):
            q.put(_STOP)
        for t in self._threads:
            t.join(5.0)
        self.store.close()

    # ---- the threads ---------------------------------------------------------------------------
    def _faults(self) -> int:
        """Calls that failed or were skipped while backing off (a concurrent write's count too: a fault
        during a lookup is what matters, and faults come together)."""
        stats = self.store.stats()
        return stats.errors + stats.skipped

    def _write(self, job: tuple[list[str], list[bytes]]) -> None:
        keys, payloads = job
        self.store.put_pages(keys, payloads)

    def _read(self, prefetch: Prefetch) -> None:
        if prefetch.phase is PrefetchPhase.LOOKUP:
            before = self._faults()
            prefetch.num_found = self.store.match_len(prefetch.keys)
            if not prefetch.num_found and self._faults() > before:
                prefetch.error = self.store.last_error or "L3 unavailable"  # a fault, not an absent prefix
            return
        prefetch.num_found = self.read_now(prefetch.keys[:len(prefetch.host_pages)], prefetch.host_pages)

    def read_now(self, keys: list[str], host_pages: list[int]) -> int:
        """Get `keys` from the store into `host_pages` on the caller's thread; how many leading pages
        arrived (a store fault is a miss)."""
        got = 0
        for page, payload in zip(host_pages, self.store.get_pages(keys)):
            if payload is None:
                break
            self._bytes.unpack(page, payload)
            got += 1
        return got


def _stop_all(queues: Iterable[queue.Queue]) -> None:
    for q in queues:
        q.put(_STOP)


def _serve(jobs: queue.Queue, tier_ref: weakref.ref, method: str) -> None:
    """One of the tier's threads: run its jobs until told to stop (or the tier is gone)."""
    while True:
        job = jobs.get()
        if job is _STOP:
            jobs.task_done()
            return
        tier = tier_ref()
        try:
            if tier is None:
                raise RuntimeError("the L3 tier was dropped")
            getattr(tier, method)(job)
        except Exception as exc:  # noqa: BLE001 - a miss, never a crash: the store reports its own faults
            log.warning("L3 %s failed: %s", method, exc)
            if isinstance(job, Prefetch):
                job.error, job.num_found = str(exc), 0
        del tier
        if isinstance(job, Prefetch):
            job._done.set()
        jobs.task_done()
