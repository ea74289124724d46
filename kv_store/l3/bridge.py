"""The tree's side of L3 (docs/design.md §5): page keys of tree nodes, writes of nodes that got a host
copy, and the prefetch life cycle (lookup -> host pages lent -> fetch -> attach as a host-only node).

`L3Bridge` runs on the scheduler's thread; the I/O is `L3Tier`'s (its threads). The host cache owns
one bridge (`NullBridge` without L3) and calls it at fixed points: `write` when a node got its host
copy, `start` on a request's first look, `poll` every step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from kv_store.l3.config import PrefetchPolicy
from kv_store.l3.keys import ROOT_KEY
from kv_store.l3.redis_store import L3Stats
from kv_store.l3.tier import L3, L3Counters, Prefetch, PrefetchPhase
from kv_store.page_pool import PagePool
from kv_store.radix_cache import RadixPrefixCache
from kv_store.residency import Residency
from kv_store.tree_node import TreeNode


class L3Bridge:
    def __init__(self, l3: L3, tree: RadixPrefixCache, pool: PagePool, host_room: Callable[[int], bool]):
        self.l3, self.tree, self.pool, self.host_room = l3, tree, pool, host_room
        self.config = l3.config
        self.counters = l3.counters
        self.prefetches: dict[int, Prefetch] = {}
        self._polling = False

    def write(self, node: TreeNode) -> None:
        """`node` just got its host copy: send its pages to L3 unless it went (or came from) there."""
        if not node.in_l3:
            self.l3.put(self.node_keys(node), node.host_pages)
            node.in_l3 = True

    def start(self, token_ids: Sequence[int], max_match_tokens: int, pos: int,
              path: list[TreeNode]) -> Prefetch | None:
        """An L3 lookup of the whole pages of `token_ids[:max_match_tokens]` past the local match `pos`,
        when there are at least `prefetch_min_pages` of them."""
        ps = self.pool.page_size
        end = min(len(token_ids), max_match_tokens) // ps * ps
        if (end - pos) // ps < self.config.prefetch_min_pages:
            return None
        parent_key = self.node_keys(path[-1])[-1] if path else ROOT_KEY
        keys = self.l3.keys(token_ids[pos:end], parent_key)
        prefetch = self.l3.start_prefetch(token_ids[:end], pos // ps, keys)
        self.prefetches[prefetch.id] = prefetch
        return prefetch

    def waited_for(self, prefetch: Prefetch | None) -> Prefetch | None:
        """What a request's ticket waits for, per the policy (best_effort: nothing)."""
        return None if self.config.policy is PrefetchPolicy.BEST_EFFORT else prefetch

    def done(self, prefetch: Prefetch) -> bool:
        """Whether a request waiting for `prefetch` may go on."""
        if prefetch.phase is PrefetchPhase.DONE:
            return True
        return self.config.policy is PrefetchPolicy.TIMEOUT and time.monotonic() >= prefetch.deadline

    def poll(self) -> None:
        """Advance every prefetch whose phase the read thread finished. Not re-entrant: a poll reached
        from inside another (an attach's walk settling a node) returns at once, so no prefetch
        advances twice and the tree never changes under a walk in progress."""
        if self._polling:
            return
        self._polling = True
        try:
            for prefetch in [pf for pf in self.prefetches.values() if pf.step_done()]:
                self._advance(prefetch)
        finally:
            self._polling = False

    def wait_any(self, timeout_s: float) -> None:
        if self.prefetches:
            next(iter(self.prefetches.values())).wait(timeout_s)

    def busy(self) -> bool:
        return bool(self.prefetches)

    def fetching_pages(self) -> int:
        """Host pages lent to prefetches in flight."""
        return sum(len(pf.host_pages) for pf in self.prefetches.values())

    def node_keys(self, node: TreeNode) -> list[str]:
        """`node`'s page keys (computed once: the chain runs through its ancestors' keys)."""
        if not node.l3_keys:
            parent = node.up()
            parent_key = ROOT_KEY if parent is self.tree.root else self.node_keys(parent)[-1]
            node.l3_keys = self.l3.keys(node.key, parent_key)
        return node.l3_keys

    def store_stats(self) -> L3Stats:
        """The store's counters."""
        return self.l3.stats()

    def flush(self, timeout_s: float) -> bool:
        """Wait until the writes handed to L3 so far were sent; False on timeout."""
        return self.l3.flush(timeout_s)

    def close(self) -> None:
        self.l3.close()

    def _advance(self, pf: Prefetch) -> None:
        """The read thread finished `pf`'s phase: take host pages for what L3 has, or attach what came."""
        if pf.phase is PrefetchPhase.LOOKUP:
            if pf.error or pf.num_found < self.config.prefetch_min_pages:
                return self._end(pf, "failed" if pf.error else "short")
            if not self.host_room(pf.num_found):
                return self._end(pf, "no_room")
            pages = self.pool.alloc(pf.num_found, pf)
            self.pool.hand_off(pages, pf, pf)
            return self.l3.fetch(pf, pages)
        pf.num_found = self.l3.arrived(pf)
        self.pool.retire(pf)
        attached = self._attach(pf)
        self.pool.free([p for p in pf.host_pages if p not in attached], pf)
        asked = len(pf.host_pages)
        pf.host_pages = []
        self._end(pf, "completed" if pf.num_found == asked else "partial" if pf.num_found else "failed")

    def _end(self, pf: Prefetch, outcome: str) -> None:
        pf.outcome = outcome
        pf.move(PrefetchPhase.DONE)
        del self.prefetches[pf.id]
        self.l3.count(outcome)

    def _attach(self, pf: Prefetch) -> list[int]:
        """Hang the pages that arrived under the tree's path of `pf.token_ids`, as a host-only node
        (those the tree has meanwhile are duplicates). Nothing attaches when the local prefix they
        continue has left the tree. Returns the host pages the tree took."""
        ps = self.pool.page_size
        end = pf.first_page + pf.num_found
        tokens = pf.token_ids[:end * ps]
        pos, path = self.tree.walk(tokens, len(tokens), lambda n: True)
        covered = pos // ps
        parent = path[-1] if path else self.tree.root
        if not pf.first_page <= covered < end or tuple(tokens[pos:pos + ps]) in parent.children:
            return []
        pages = pf.host_pages[covered - pf.first_page:pf.num_found]
        node = self.tree.add_child(parent, tuple(tokens[pos:]), Residency.HOST, host_pages=pages, in_l3=True)
        node.fetched_from_l3 = True
        self.pool.give_to_tree(pages, pf, node.id)
        return pages


class NullBridge:
    """No L3: nothing written, nothing prefetched."""

    def __init__(self) -> None:
        self.counters = L3Counters()
        self.prefetches: dict[int, Prefetch] = {}

    def write(self, node: TreeNode) -> None:
        pass

    def start(self, token_ids: Sequence[int], max_match_tokens: int, pos: int,
              path: list[TreeNode]) -> Prefetch | None:
        return None

    def waited_for(self, prefetch: Prefetch | None) -> Prefetch | None:
        return None

    def done(self, prefetch: Prefetch) -> bool:
        return True

    def poll(self) -> None:
        pass

    def wait_any(self, timeout_s: float) -> None:
        pass

    def busy(self) -> bool:
        return False

    def fetching_pages(self) -> int:
        return 0

    def store_stats(self) -> None:
        return None

    def flush(self, timeout_s: float) -> bool:
        return True

    def close(self) -> None:
        pass
