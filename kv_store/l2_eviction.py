"""L2 eviction (DESIGN §5): which host copies of the prefix tree's nodes give up their host pages when
the host tier needs room, and in what order.

Host copies of nodes still on device go first (dropping one costs nothing: the device pages stay
valid), then unlocked host-only leaves; least recently used first in each group. A host-pinned node
(`TreeNode.host_pins`, an offloaded session) keeps its copy.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from kv_store.radix_cache import RadixPrefixCache
from kv_store.residency import Residency, move_residency
from kv_store.tree_node import TreeNode


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
        parent = node.parent
        freed += len(node.host_pages)
        tree.drop_subtree(node)
        if parent is not tree.root and _host_leaf(parent):
            heapq.heappush(leaves, (parent.last_access, parent.id, parent))
    return freed


def _host_leaf(node: TreeNode) -> bool:
    return node.residency is Residency.HOST and node.lock_ref == node.host_pins == 0 and not node.children
