"""Page-granular radix prefix cache over token ids (DESIGN §3, §4 rule 4).

The tree owns CACHED pages. Every node holds a whole number of pages: `len(node.key) ==
len(node.pages) * page_size`, so every prefix length the tree hands out is page-aligned by
construction. Children are keyed by their first page of tokens, so two children never share a
first page.

Locking: `lock(node)` adds one reference to the node and each ancestor; a node with `lock_ref > 0`
is never evicted. Eviction removes unlocked leaves in LRU order and frees their pages. Two kinds of
holder lock a path: a live request (its cached prefix) and a transfer handle that reads cached pages
(`KVManager.pin_for_transfer`: the pin outlives the request if the request is retracted first).
`NullPrefixCache` is the same interface with nothing cached (prefix caching disabled).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from kv_store.page_pool import PagePool, PageState


@dataclass(eq=False)
class TreeNode:
    id: int
    parent: "TreeNode | None"  # None only for the root
    key: tuple[int, ...]  # token ids, len == len(pages) * page_size
    pages: list[int]
    children: dict[tuple[int, ...], "TreeNode"] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0


@dataclass(frozen=True)
class PrefixMatch:
    """Result of `match`: `pages` hold tokens [0, num_tokens); `node` is the deepest matched node."""

    num_tokens: int
    pages: list[int]
    node: TreeNode


class RadixPrefixCache:
    """Radix tree of cached KV pages; shares its `PagePool` with the requests' private pages."""

    def __init__(self, pool: PagePool):
        self.pool = pool
        self.page_size = pool.page_size
        self._ids = itertools.count(1)
        self._clock = itertools.count(1)
        self.root = TreeNode(id=0, parent=None, key=(), pages=[])

    # ---- lookup --------------------------------------------------------------------------------
    def match(self, token_ids: list[int] | tuple[int, ...], max_tokens: int) -> PrefixMatch:
        """Longest cached prefix of `token_ids[:max_tokens]`, rounded down to whole pages.

        Splits a node when the match ends inside it (at a page boundary), so the returned node
        covers exactly the matched prefix. Touches the LRU clock of the matched path. Mutates the
        tree shape only; page ownership does not change.
        """
        ps = self.page_size
        limit = min(len(token_ids), max_tokens) // ps * ps
        node, pos, pages = self.root, 0, []
        now = next(self._clock)
        while pos < limit:
            child = node.children.get(tuple(token_ids[pos:pos + ps]))
            if child is None:
                break
            n = self._common_pages(child.key, token_ids, pos, limit)
            if n < len(child.pages):
                child = self._split(child, n)
            child.last_access = now
            pages.extend(child.pages)
            pos += len(child.key)
            node = child
        return PrefixMatch(pos, pages, node)

    def lock(self, node: TreeNode) -> None:
        """Protect `node` and its ancestors from eviction (one reference each)."""
        while node is not self.root:
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node is not self.root:
            assert node.lock_ref > 0, f"tree node {node.id} unlocked more often than locked: release ran twice?"
            node.lock_ref -= 1
            node = node.parent

    def holds(self, node: TreeNode) -> bool:
        """Whether `node` is still in the tree (not evicted, not dropped)."""
        ps = self.page_size
        while node is not self.root:
            if node.parent is None or node.parent.children.get(node.key[:ps]) is not node:
                return False
            node = node.parent
        return True

    def path_pages(self, node: TreeNode) -> list[int]:
        """The pages on the path root -> `node`, in token order: what locking `node` protects."""
        chunks = []
        while node is not self.root:
            chunks.append(node.pages)
            node = node.parent
        return [p for chunk in reversed(chunks) for p in chunk]

    # ---- insert --------------------------------------------------------------------------------
    def insert(self, token_ids: list[int], pages: list[int], owner: object) -> int:
        """Cache `pages` (holding `token_ids`, a whole number of pages) for the future.

        Returns `num_existing_tokens`: the prefix that was already in the tree. Pages of `pages`
        below that length are NOT taken (the caller still owns and must free those that are its
        own); pages from that length on are taken over (PRIVATE(owner) -> CACHED).

            | already in tree: caller keeps its pages | new: tree takes pages[existing/ps:] |
            0                                num_existing_tokens                   len(token_ids)
        """
        ps = self.page_size
        assert len(token_ids) == len(pages) * ps, (
            f"insert of {len(token_ids)} tokens with {len(pages)} pages at page_size {ps}: partial page inserted?")
        existing = self.match(token_ids, len(token_ids))
        if existing.num_tokens == len(token_ids):
            return existing.num_tokens
        new_pages = pages[existing.num_tokens // ps:]
        node = TreeNode(id=next(self._ids), parent=existing.node, key=tuple(token_ids[existing.num_tokens:]),
                        pages=list(new_pages), last_access=next(self._clock))
        self.pool.give_to_tree(new_pages, owner, node.id)
        existing.node.children[node.key[:ps]] = node
        return existing.num_tokens

    # ---- eviction ------------------------------------------------------------------------------
    def evict(self, num_pages: int) -> int:
        """Free `num_pages` pages from the tails of unlocked leaves, least recently used first (fewer
        if not enough are evictable). Returns the number freed."""
        heap = [(n.last_access, n.id, n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, node = heapq.heappop(heap)
            keep = max(0, len(node.pages) - (num_pages - freed))
            self.pool.evict(node.pages[keep:], node.id)
            freed += len(node.pages) - keep
            if keep:  # trim the leaf's tail; its prefix stays cached
                node.key, node.pages = node.key[:keep * self.page_size], node.pages[:keep]
                break
            parent = node.parent
            del parent.children[node.key[:self.page_size]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return freed

    def evictable_pages(self) -> int:
        """Pages that `evict` could free now (in subtrees with no lock)."""
        return sum(len(n.pages) for n in self._nodes() if n.lock_ref == 0)

    def cached_pages(self) -> int:
        return sum(len(n.pages) for n in self._nodes())

    # ---- checks --------------------------------------------------------------------------------
    def check_integrity(self, expected_locks: dict[int, int] | None = None) -> None:
        """Tree shape, page ownership, and (given per-node lock counts) lock references.

        `expected_locks` maps node id -> number of holders (live requests, transfer pins) locking
        that node; each node's lock_ref must equal the sum over its subtree.
        """
        ps = self.page_size
        seen_pages: set[int] = set()
        for node in self._nodes():
            assert len(node.key) == len(node.pages) * ps and node.pages, (
                f"tree node {node.id} holds {len(node.key)} tokens in {len(node.pages)} pages: not page-aligned")
            for first, child in node.children.items():
                assert child.parent is node and child.key[:ps] == first, f"tree node {child.id} misfiled under {node.id}"
            for p in node.pages:
                assert p not in seen_pages, f"page {p} in two tree nodes: inserted twice?"
                seen_pages.add(p)
                assert self.pool.state(p) is PageState.CACHED and self.pool.owner(p) == node.id, (
                    f"tree node {node.id} lists page {p} but the pool says {self.pool.state(p)} owned by "
                    f"{self.pool.owner(p)!r}: freed behind the tree's back?")
            assert node.lock_ref >= 0, f"tree node {node.id} lock_ref {node.lock_ref} < 0"
        num_cached = self.pool.usage().cached
        assert num_cached == len(seen_pages), (
            f"pool has {num_cached} CACHED pages but the tree holds {len(seen_pages)}: a node dropped without evict?")
        if expected_locks is not None:
            self._check_locks(self.root, expected_locks)

    def _check_locks(self, node: TreeNode, expected: dict[int, int]) -> int:
        total = expected.get(node.id, 0) + sum(self._check_locks(c, expected) for c in node.children.values())
        if node is not self.root:
            assert node.lock_ref == total, (
                f"tree node {node.id} lock_ref {node.lock_ref} but {total} holders (requests, transfer pins) lock it "
                "or a descendant: a release or unpin skipped unlock, or unlocked twice?")
        return total

    # ---- helpers -------------------------------------------------------------------------------
    def _common_pages(self, key: tuple[int, ...], token_ids, pos: int, limit: int) -> int:
        """Number of whole pages of `key` equal to `token_ids[pos:limit]`."""
        ps, n = self.page_size, 0
        while n * ps < len(key) and pos + (n + 1) * ps <= limit:
            if tuple(token_ids[pos + n * ps: pos + (n + 1) * ps]) != key[n * ps:(n + 1) * ps]:
                break
            n += 1
        return n

    def _split(self, node: TreeNode, num_pages: int) -> TreeNode:
        """Split `node` after `num_pages` pages; returns the new upper part (which inherits the lock)."""
        ps = self.page_size
        upper = TreeNode(id=next(self._ids), parent=node.parent, key=node.key[:num_pages * ps],
                         pages=node.pages[:num_pages], lock_ref=node.lock_ref, last_access=node.last_access)
        self.pool.retag_cached(upper.pages, node.id, upper.id)
        node.parent.children[upper.key[:ps]] = upper
        node.key, node.pages, node.parent = node.key[num_pages * ps:], node.pages[num_pages:], upper
        upper.children[node.key[:ps]] = node
        return upper

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _leaves(self):
        return (n for n in self._nodes() if not n.children)


class NullPrefixCache:
    """Prefix caching disabled: nothing matches, insert takes no pages, nothing to evict."""

    def __init__(self, pool: PagePool):
        self.pool = pool
        self.page_size = pool.page_size
        self.root = TreeNode(id=0, parent=None, key=(), pages=[])

    def match(self, token_ids, max_tokens: int) -> PrefixMatch:
        return PrefixMatch(0, [], self.root)

    def lock(self, node: TreeNode) -> None:
        assert node is self.root, "NullPrefixCache only ever hands out its root"

    def unlock(self, node: TreeNode) -> None:
        assert node is self.root, "NullPrefixCache only ever hands out its root"

    def holds(self, node: TreeNode) -> bool:
        return node is self.root

    def path_pages(self, node: TreeNode) -> list[int]:
        return []

    def insert(self, token_ids, pages, owner) -> int:
        """Takes nothing: returns len(token_ids) so the caller frees all its pages itself."""
        return len(token_ids)

    def evict(self, num_pages: int) -> int:
        return 0

    def evictable_pages(self) -> int:
        return 0

    def cached_pages(self) -> int:
        return 0

    def check_integrity(self, expected_locks=None) -> None:
        assert not self.root.children, "NullPrefixCache grew a tree"
