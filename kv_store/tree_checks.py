"""The prefix tree's integrity check (`RadixPrefixCache.check_integrity`, DESIGN §3, §5): tree shape,
residency, device page ownership, and the holders behind each node's lock and host-pin counts.

Read-only; it walks every node and page. The tier's own pages are checked by the tier's `check_node`
and `check_integrity`, which this calls.
"""

from __future__ import annotations

from kv_store.page_pool import PagePool, PageState
from kv_store.tree_node import TreeNode, TreeTier, subtree


def check_tree(root: TreeNode, pool: PagePool, tier: TreeTier, expected_locks: dict[int, int] | None = None,
               expected_host_pins: dict[int, int] | None = None) -> None:
    """Tree shape, residency, page ownership, and (given per-node counts) lock references and host pins
    of the tree under `root`, whose device pages are CACHED in `pool` and whose `tier` is attached.

    `expected_locks` maps node id -> number of holders (live requests, transfer pins) locking
    that node; the tier adds its own. Each node's lock_ref must equal the sum over its subtree;
    likewise host_pins with `expected_host_pins`.
    """
    ps = pool.page_size
    seen_pages: set[int] = set()
    for node in subtree(root):
        _check_node(node, root, pool, tier, seen_pages)
        for first, child in node.children.items():
            assert child.parent is node and child.key[:ps] == first, f"tree node {child.id} misfiled under {node.id}"
    num_cached = pool.usage().cached
    assert num_cached == len(seen_pages), (
        f"pool has {num_cached} CACHED pages but the tree holds {len(seen_pages)}: a node dropped without evict?")
    tier.check_integrity()
    if expected_locks is not None:
        locks = dict(expected_locks)
        for node in tier.holders():
            locks[node.id] = locks.get(node.id, 0) + 1
        _check_locks(node=root, root=root, expected=locks)
    if expected_host_pins is not None:
        _check_locks(node=root, root=root, expected=dict(expected_host_pins), field="host_pins")


def _check_node(node: TreeNode, root: TreeNode, pool: PagePool, tier: TreeTier, seen_pages: set[int]) -> None:
    ps = pool.page_size
    n = len(node.key) // ps
    assert n > 0 and len(node.key) == n * ps, f"tree node {node.id} holds {len(node.key)} tokens: not page-aligned"
    on_device = node.residency.on_device
    assert len(node.pages) == (n if on_device else 0), (
        f"tree node {node.id} is {node.residency.value} with {len(node.pages)} device pages for {n} pages of tokens")
    if on_device and node.up() is not root:
        assert node.up().residency.on_device, (
            f"tree node {node.id} is on device but its parent {node.up().id} is {node.up().residency.value}: "
            "evicted a node whose child was still on device?")
    for p in node.pages:
        assert p not in seen_pages, f"page {p} in two tree nodes: inserted twice?"
        seen_pages.add(p)
        assert pool.state(p) is PageState.CACHED and pool.owner(p) == node.id, (
            f"tree node {node.id} lists page {p} but the pool says {pool.state(p)} owned by "
            f"{pool.owner(p)!r}: freed behind the tree's back?")
    assert node.lock_ref >= 0, f"tree node {node.id} lock_ref {node.lock_ref} < 0"
    tier.check_node(node)


def _check_locks(node: TreeNode, root: TreeNode, expected: dict[int, int], field: str = "lock_ref") -> int:
    total = expected.get(node.id, 0) + sum(_check_locks(c, root, expected, field) for c in node.children.values())
    if node is not root:
        assert getattr(node, field) == total, (
            f"tree node {node.id} {field} {getattr(node, field)} but {total} holders (requests, transfer pins, "
            "session pins, tier copies) hold it or a descendant: a release or unpin skipped unlock, or "
            "unlocked twice?")
    return total
