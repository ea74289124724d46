"""Page-granular radix prefix cache over token ids, with per-node tier residency (DESIGN §3, §4 rule 4, §5).

The tree owns CACHED pages. Every node holds a whole number of pages: `len(node.key) ==
node.num_pages * page_size`, so every prefix length the tree hands out is page-aligned by
construction. Children are keyed by their first page of tokens, so two children never share a
first page.

Tiers. A node's `residency` says where its pages are valid (`kv_store/tree_node.py`, with the node
and match records). Nodes on device form a prefix-closed set (a node on device has its parent on
device), so a match is a device run followed by a host run. What happens to a node that leaves L1 is
the attached tier's business (`L1Only` drops it; `kv_store/host_cache.py:HostCache` keeps it on the host).

Locking: `lock(node)` adds one reference to the node and each ancestor; a node with `lock_ref > 0`
leaves no tier. Holders: a live request (its cached prefix), a transfer handle that reads cached
pages (`KVManager.pin_for_transfer`: the pin outlives the request if the request is retracted
first), and the tier's own copies and load tickets (`tier.holders()`). Eviction takes unlocked
nodes with nothing of theirs below them on device, least recently used first.
`NullPrefixCache` is the same interface with nothing cached (prefix caching disabled). The tree's
integrity check is `kv_store/tree_checks.py`.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence

from kv_store.page_pool import PagePool
from kv_store.residency import Residency, move_residency
from kv_store.tree_checks import check_tree
from kv_store.tree_node import PrefixMatch, TreeNode, TreeTier, subtree


class L1Only:
    """No tier below the device: a node leaving L1 is dropped, copies and loads never happen."""

    def __init__(self, tree: RadixPrefixCache):
        self.tree = tree

    def leave_l1(self, node: TreeNode) -> int:
        return 0 if node.host_pins else self.tree.drop_subtree(node)

    def on_insert(self, node: TreeNode) -> None:
        pass

    def on_hit(self, node: TreeNode) -> None:
        pass

    def drain(self) -> bool:
        return False

    def settle(self, node: TreeNode) -> bool:
        return True

    def free_host(self, node: TreeNode) -> None:
        raise AssertionError(f"tree node {node.id} has host pages but this cache has no host tier")

    def retag_host(self, pages: list[int], old_node_id: int, new_node_id: int) -> None:
        assert not pages, "host pages in a cache with no host tier"

    def holders(self) -> list[TreeNode]:
        return []

    def device_pages_held(self) -> int:
        return 0

    def check_node(self, node: TreeNode) -> None:
        assert node.residency is Residency.DEVICE and not node.host_pages, (
            f"tree node {node.id} is {node.residency.value} but this cache has no host tier")

    def check_integrity(self) -> None:
        pass


class RadixPrefixCache:
    """Radix tree of cached KV pages; shares its `PagePool` with the requests' private pages."""

    def __init__(self, pool: PagePool):
        self.pool = pool
        self.page_size = pool.page_size
        self._ids = itertools.count(1)
        self._clock = itertools.count(1)
        self.root = TreeNode(id=0, parent=None, key=(), pages=[])
        self.tier: TreeTier = L1Only(self)

    def attach_tier(self, tier: TreeTier) -> None:
        """Below L1 from now on: `tier` (`kv_store/host_cache.py:HostCache`) gets the tree's hooks. Called
        once, by the engine's builder, before any node exists."""
        assert isinstance(self.tier, L1Only) and not self.root.children, "attach the tier to an empty, bare tree"
        self.tier = tier

    def num_pages(self, node: TreeNode) -> int:
        return len(node.key) // self.page_size

    # ---- lookup --------------------------------------------------------------------------------
    def match(self, token_ids: list[int] | tuple[int, ...], max_match_tokens: int) -> PrefixMatch:
        """Longest prefix of `token_ids[:max_match_tokens]` cached *on device*, rounded down to whole
        pages.

        Splits a node when the match ends inside it (at a page boundary), so the returned node
        covers exactly the matched prefix. Touches the LRU clock and hit count of the matched path
        (the tier may start a backup on a hit). Mutates the tree shape only; page ownership does
        not change.
        """
        pos, path = self.walk(token_ids, max_match_tokens, lambda n: n.residency.on_device)
        for node in path:
            node.hits += 1
            self.tier.on_hit(node)
        pages = [p for node in path for p in node.pages]
        return PrefixMatch(pos, pages, path[-1] if path else self.root)

    def cached_len(self, token_ids: Sequence[int]) -> int:
        """Whole-page prefix of `token_ids` the tree holds in any tier. Read-only: no split, no LRU
        touch, no hit counted."""
        node, pos, limit = self.root, 0, len(token_ids) // self.page_size * self.page_size
        while pos < limit:
            child = node.children.get(tuple(token_ids[pos:pos + self.page_size]))
            if child is None:
                break
            n = self._common_pages(child.key, token_ids, pos, limit)
            pos += n * self.page_size
            if n < self.num_pages(child):
                break
            node = child
        return pos

    def walk(self, token_ids: Sequence[int], max_match_tokens: int,
             admit: Callable[[TreeNode], bool]) -> tuple[int, list[TreeNode]]:
        """(tokens matched, the nodes matched in order) along `token_ids[:max_match_tokens]`, following
        only nodes `admit` accepts. A match ending inside a node splits it; a node with a copy in
        flight cannot be split (its pages cannot be retagged), so the walk waits for that copy first,
        and stops before the node if it does not finish in time."""
        ps = self.page_size
        limit = min(len(token_ids), max_match_tokens) // ps * ps
        node, pos, path = self.root, 0, []
        now = next(self._clock)
        while pos < limit:
            child = node.children.get(tuple(token_ids[pos:pos + ps]))
            if child is None or not admit(child):
                break
            n = self._common_pages(child.key, token_ids, pos, limit)
            if n < self.num_pages(child):
                if not self.tier.settle(child) or not admit(child):
                    break
                child = self._split(child, n)
            child.last_access = now
            path.append(child)
            pos += len(child.key)
            node = child
        return pos, path

    def lock(self, node: TreeNode) -> None:
        """Protect `node` and its ancestors from eviction in every tier (one reference each)."""
        while node is not self.root:
            node.lock_ref += 1
            node = node.up()

    def unlock(self, node: TreeNode) -> None:
        while node is not self.root:
            assert node.lock_ref > 0, f"tree node {node.id} unlocked more often than locked: release ran twice?"
            node.lock_ref -= 1
            node = node.up()

    def pin_host(self, node: TreeNode) -> None:
        """Keep `node` and its ancestors in the tree, in any tier (one reference each): they may leave
        the device, written back to the host tier, but are never dropped from it."""
        while node is not self.root:
            node.host_pins += 1
            node = node.up()

    def unpin_host(self, node: TreeNode) -> None:
        while node is not self.root:
            assert node.host_pins > 0, f"tree node {node.id} host-unpinned more often than pinned"
            node.host_pins -= 1
            node = node.up()

    def holds(self, node: TreeNode) -> bool:
        """Whether `node` is still in the tree (not evicted, not dropped)."""
        ps = self.page_size
        while node is not self.root:
            if node.parent is None or node.parent.children.get(node.key[:ps]) is not node:
                return False
            node = node.up()
        return True

    def path_pages(self, node: TreeNode) -> list[int]:
        """The device pages on the path root -> `node`, in token order: what locking `node` protects."""
        chunks = []
        while node is not self.root:
            chunks.append(node.pages)
            node = node.up()
        return [p for chunk in reversed(chunks) for p in chunk]

    # ---- insert --------------------------------------------------------------------------------
    def insert(self, token_ids: list[int], pages: list[int], owner: object) -> list[int]:
        """Cache `pages` (device pages of `owner` holding `token_ids`, a whole number of pages).

        Returns the pages the tree took over (PRIVATE(owner) -> CACHED); the caller still owns, and
        must free, the rest. Along the path, a page whose tokens are already on device is not
        taken (a duplicate); one whose tokens are only on the host is taken as that node's device
        copy (HOST -> BOTH); the part past the tree's path becomes a new node. A node whose load is
        in flight ends the insert there (its load brings the same KV).

            | on device: dup | host only: taken | ... | new node: taken |       (page index ->)
            0                                                     len(pages)
        """
        ps = self.page_size
        assert len(token_ids) == len(pages) * ps, (
            f"insert of {len(token_ids)} tokens with {len(pages)} pages at page_size {ps}: partial page inserted?")
        node, pos, taken, now = self.root, 0, [], next(self._clock)
        while pos < len(token_ids):
            child = node.children.get(tuple(token_ids[pos:pos + ps]))
            if child is None:
                new = self.add_child(node, tuple(token_ids[pos:]), Residency.DEVICE, pages=list(pages[pos // ps:]))
                self.pool.give_to_tree(new.pages, owner, new.id)
                taken += new.pages
                self.tier.on_insert(new)
                break
            n = self._common_pages(child.key, token_ids, pos, len(token_ids))
            if (n < self.num_pages(child) and not self.tier.settle(child)) or child.residency is Residency.LOADING:
                break
            if n < self.num_pages(child):
                child = self._split(child, n)
            if not child.residency.on_device:
                taken += self._fill_device(child, pages[pos // ps:pos // ps + n], owner)
            child.last_access = now
            pos += len(child.key)
            node = child
        return taken

    def add_child(self, parent: TreeNode, key: tuple[int, ...], residency: Residency, pages: Sequence[int] = (),
                  host_pages: Sequence[int] = (), in_l3: bool = False) -> TreeNode:
        """A new node under `parent` (no child of which starts with `key`'s first page). The caller
        hands it its pages in their pools."""
        first = key[:self.page_size]
        assert first not in parent.children, f"tree node {parent.id} already has a child starting {first}"
        node = TreeNode(id=next(self._ids), parent=parent, key=key, pages=list(pages), last_access=next(self._clock),
                        host_pages=list(host_pages), residency=residency, in_l3=in_l3)
        parent.children[first] = node
        return node

    def _fill_device(self, node: TreeNode, pages: list[int], owner: object) -> list[int]:
        self.pool.give_to_tree(pages, owner, node.id)
        node.pages = list(pages)
        node.residency = move_residency(node.residency, Residency.BOTH, f"tree node {node.id} recomputed")
        return node.pages

    # ---- eviction ------------------------------------------------------------------------------
    def evict(self, num_pages: int) -> int:
        """Free `num_pages` device pages from unlocked nodes with nothing of theirs on device below them,
        least recently used first (fewer if not enough are evictable; more when a node's copy to
        the host could not be trimmed). When nothing is evictable but the tier has copies in flight
        (locked nodes), waits for them and tries again. Returns the number freed."""
        freed = 0
        while freed < num_pages:
            got = self._evict_round(num_pages - freed)
            freed += got
            if got == 0 and not self.tier.drain():
                break
        return freed

    def _evict_round(self, num_pages: int) -> int:
        heap = [(n.last_access, n.id, n) for n in self.nodes() if self._l1_evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, node = heapq.heappop(heap)
            if not self.holds(node) or not self._l1_evictable(node):
                continue
            keep = max(0, self.num_pages(node) - (num_pages - freed))
            if keep:  # trim the node's tail; its prefix stays on device
                self._split(node, keep)
            parent = node.up()
            freed += self.tier.leave_l1(node)
            if keep:
                break
            if parent is not self.root and self._l1_evictable(parent):
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return freed

    def _l1_evictable(self, node: TreeNode) -> bool:
        return (node.residency in (Residency.DEVICE, Residency.BOTH) and node.lock_ref == 0
                and not any(c.residency.on_device or c.residency is Residency.LOADING for c in node.children.values()))

    def drop_subtree(self, node: TreeNode) -> int:
        """Remove `node` and everything below it from the tree, freeing their pages in every tier
        (none may be locked or in transit). Returns the device pages freed."""
        freed = 0
        for child in list(node.children.values()):
            freed += self.drop_subtree(child)
        assert node.lock_ref == 0 and node.host_pins == 0 and not node.residency.in_transit, (
            f"tree node {node.id} dropped while locked ({node.lock_ref}), host-pinned ({node.host_pins}) "
            f"or {node.residency.value}")
        if node.pages:
            self.pool.evict(node.pages, node.id)
            freed += len(node.pages)
        if node.host_pages:
            self.tier.free_host(node)
        del node.up().children[node.key[:self.page_size]]
        return freed

    def evictable_pages(self) -> int:
        """Device pages `evict` could free now (on device, in subtrees with no lock)."""
        return sum(len(n.pages) for n in self.nodes()
                   if n.lock_ref == 0 and n.residency in (Residency.DEVICE, Residency.BOTH))

    def cached_pages(self) -> int:
        return sum(len(n.pages) for n in self.nodes())

    def pages_held_by_tier(self) -> int:
        """Device pages the tier holds outside the tree and every request (loads in flight)."""
        return self.tier.device_pages_held()

    # ---- checks --------------------------------------------------------------------------------
    def check_integrity(self, expected_locks: dict[int, int] | None = None,
                        expected_host_pins: dict[int, int] | None = None) -> None:
        """Tree shape, residency, page ownership, and (given per-node holder counts) lock references and
        host pins: `kv_store/tree_checks.py:check_tree`."""
        check_tree(self.root, self.pool, self.tier, expected_locks, expected_host_pins)

    # ---- helpers -------------------------------------------------------------------------------
    def _common_pages(self, key: tuple[int, ...], token_ids: Sequence[int], pos: int, limit: int) -> int:
        """Number of whole pages of `key` equal to `token_ids[pos:limit]`."""
        ps, n = self.page_size, 0
        while n * ps < len(key) and pos + (n + 1) * ps <= limit:
            if tuple(token_ids[pos + n * ps: pos + (n + 1) * ps]) != key[n * ps:(n + 1) * ps]:
                break
            n += 1
        return n

    def _split(self, node: TreeNode, num_pages: int) -> TreeNode:
        """Split `node` after `num_pages` pages; returns the new upper part (which inherits the lock,
        residency and hits). No copy may be in flight for `node`."""
        assert not node.residency.in_transit, f"tree node {node.id} split while {node.residency.value}"
        ps = self.page_size
        upper = TreeNode(id=next(self._ids), parent=node.parent, key=node.key[:num_pages * ps],
                         pages=node.pages[:num_pages], lock_ref=node.lock_ref, host_pins=node.host_pins,
                         last_access=node.last_access,
                         host_pages=node.host_pages[:num_pages], residency=node.residency, hits=node.hits,
                         in_l3=node.in_l3, fetched_from_l3=node.fetched_from_l3, l3_keys=node.l3_keys[:num_pages])
        self.pool.retag_cached(upper.pages, node.id, upper.id)
        self.tier.retag_host(upper.host_pages, node.id, upper.id)
        node.up().children[upper.key[:ps]] = upper
        node.key, node.pages, node.parent = node.key[num_pages * ps:], node.pages[num_pages:], upper
        node.host_pages, node.l3_keys = node.host_pages[num_pages:], node.l3_keys[num_pages:]
        upper.children[node.key[:ps]] = node
        return upper

    def nodes(self) -> Iterator[TreeNode]:
        return subtree(self.root)


class NullPrefixCache:
    """Prefix caching disabled: nothing matches, insert takes no pages, nothing to evict."""

    def __init__(self, pool: PagePool):
        self.pool = pool
        self.page_size = pool.page_size
        self.root = TreeNode(id=0, parent=None, key=(), pages=[])

    def match(self, token_ids: list[int] | tuple[int, ...], max_match_tokens: int) -> PrefixMatch:
        return PrefixMatch(0, [], self.root)

    def cached_len(self, token_ids: Sequence[int]) -> int:
        return 0

    def lock(self, node: TreeNode) -> None:
        assert node is self.root, "NullPrefixCache only ever hands out its root"

    unlock = pin_host = unpin_host = lock  # the same check: nothing below the root to count

    def holds(self, node: TreeNode) -> bool:
        return node is self.root

    def path_pages(self, node: TreeNode) -> list[int]:
        return []

    def insert(self, token_ids: list[int], pages: list[int], owner: object) -> list[int]:
        """Takes nothing: the caller frees all its pages itself."""
        return []

    def evict(self, num_pages: int) -> int:
        return 0

    def evictable_pages(self) -> int:
        return 0

    def cached_pages(self) -> int:
        return 0

    def pages_held_by_tier(self) -> int:
        return 0

    def check_integrity(self, expected_locks: dict[int, int] | None = None,
                        expected_host_pins: dict[int, int] | None = None) -> None:
        assert not self.root.children, "NullPrefixCache grew a tree"
