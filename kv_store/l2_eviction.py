"""L2 eviction (DESIGN §5): which host copies of the prefix tree's nodes give up their host pages when
the host tier needs room, and in what order.

Host copies of nodes still on device go first (dropping one costs nothing: the device pages stay
valid), then unlocked host-only leaves; least recently used first in each group. A host-pinned node
(`TreeNode.host_pins`, an offloaded session) keeps its copy.

A host copy whose bytes changed since its backup wrote them (its digests, `kv_store/tier_sums.py`,
checked as a load-back starts: `corrupt_copy`), or whose last load-back failed, is never loaded: it
and every node below it leave the tree (`drop_unheld`), counted and logged, and the requests that
wanted them compute them again.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable
from typing import Protocol

from kv_store.radix_cache import RadixPrefixCache
from kv_store.residency import Residency, move_residency
from kv_store.tier_copies import TierCounters
from kv_store.tier_sums import TierSums
from kv_store.tree_node import TreeNode, subtree

log = logging.getLogger(__name__)


def evict_l2(tree: RadixPrefixCache, num_pages: int, free_host: Callable[[TreeNode], None]) -> int:
    """Free `num_pages` host pages of `tree`'s nodes (fewer if not enough are evictable), in the order
    above; `free_host` frees one node's host copy (the tier's hook). Returns the number freed."""
    nodes = list(tree.nodes())
    copies = sorted((n for n in nodes if n.residency is Residency.BOTH and not n.host_pins),
                    key=lambda n: n.last_access)
    freed = 0
    for node in copies:
        if freed >= num_pages:
            return freed
        freed += len(node.host_pages)
        free_host(node)
        node.residency = move_residency(node.residency, Residency.DEVICE, f"tree node {node.id} L2 copy dropped")
    leaves = [(n.last_access, n.id, n) for n in nodes if _host_leaf(n)]
    heapq.heapify(leaves)
    while freed < num_pages and leaves:
        _, _, node = heapq.heappop(leaves)
        parent = node.up()
        freed += len(node.host_pages)
        tree.drop_subtree(node)
        if parent is not tree.root and _host_leaf(parent):
            heapq.heappush(leaves, (parent.last_access, parent.id, parent))
    return freed


def _host_leaf(node: TreeNode) -> bool:
    return node.residency is Residency.HOST and node.lock_ref == node.host_pins == 0 and not node.children


class CheckedTier(Protocol):
    """What `corrupt_copy` reads and counts in of the host tier (`kv_store/host_cache.py:HostCache`)."""

    failed_loads: set[int]
    sums: TierSums | None
    counters: TierCounters


def corrupt_copy(tier: CheckedTier, node: TreeNode, who: str) -> TreeNode | None:
    """`node` when a page of its host copy no longer has the digest its backup kept, or its last
    load-back failed (`tier`: the `HostCache`; `who`: the request that asked, for the log), else None."""
    if node.id in tier.failed_loads:
        tier.failed_loads.discard(node.id)
        log.error("request %s: cached prefix node %d failed its last load-back; it and what lies below it leave "
                  "the tree and are computed again", who or "?", node.id)
        return node
    if tier.sums is None:
        return None
    bad = tier.sums.changed_at_rest(node.host_pages)
    if not bad:
        return None
    tier.counters.l2_corrupt += len(bad)
    log.error("request %s: host page(s) %s of cached prefix node %d failed their checksum at load-back; the "
              "node and what lies below it leave the tree and are computed again", who or "?", bad, node.id)
    return node


def drop_unheld(tree: RadixPrefixCache, node: TreeNode | None) -> None:
    """Drop `node` and its subtree when nothing holds any of them (else they stay, unloaded, until then)."""
    if node is not None and all(n.lock_ref == n.host_pins == 0 and not n.residency.in_transit
                                for n in (node, *subtree(node))):
        tree.drop_subtree(node)
