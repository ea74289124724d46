"""The router's approximate prefix tree: its guess at what one worker's prefix cache holds.

The router never sees a worker's real radix cache. It records which prompts it sent where and assumes
the worker cached them. The guess goes stale when the worker evicts or restarts; that only costs a worse
routing choice, never a wrong answer, so this tree holds token ids only (no pages, no locks) and keeps
itself under a token budget by trimming least-recently-used leaves.

Pure stdlib: the routing policy that uses it must stay free of I/O and frameworks (DESIGN §8).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(eq=False)
class _Node:
    serial: int  # creation order; breaks LRU ties so eviction order is deterministic
    parent: _Node | None  # None only for the root
    key: tuple[int, ...]  # the edge label: token ids from the parent to this node (empty only at the root)
    children: dict[int, _Node] = field(default_factory=dict)  # keyed by the first token of the child's key
    last_used: int = 0  # insert tick that last passed through this node; never older than any descendant's

    def up(self) -> _Node:
        """The parent of a node below the root."""
        assert self.parent is not None, f"tree node {self.serial} has no parent: walked past the root?"
        return self.parent


def _common_prefix_len(edge: tuple[int, ...], tokens: Sequence[int], start: int) -> int:
    """Length of the common prefix of `edge` and `tokens[start:]`."""
    if tuple(tokens[start:start + len(edge)]) == edge:
        return len(edge)
    n = min(len(edge), len(tokens) - start)
    i = 0
    while i < n and edge[i] == tokens[start + i]:
        i += 1
    return i


class ApproxPrefixTree:
    """Edge-compressed radix tree over token ids with a token budget and LRU trimming.

    Contract:
      * `insert` is the only mutator: it adds a sequence, marks its whole path most recently used, then
        trims least-recently-used leaves (from their tails) until `num_tokens <= max_tokens`.
      * `match_len` is read-only, so the routing policy may call it without changing state. Recency is
        refreshed when the routed prompt is inserted, and that insert passes through the whole matched
        path, so a matched prefix is touched as soon as the route is recorded.
      * A sequence longer than `max_tokens` is inserted truncated to its first `max_tokens` tokens: a
        prefix cache keeps prefixes, and the newest insert must survive its own eviction pass.
    """

    def __init__(self, max_tokens: int):
        if not (isinstance(max_tokens, int) and max_tokens >= 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        self.max_tokens = max_tokens
        self._serials = itertools.count(1)
        self._clock = 0
        self._num_tokens = 0
        self._root = _Node(serial=0, parent=None, key=())

    @property
    def num_tokens(self) -> int:
        """Tokens held: the sum of all edge lengths (a shared prefix counts once)."""
        return self._num_tokens

    # ---- lookup --------------------------------------------------------------------------------
    def match_len(self, tokens: Sequence[int]) -> int:
        """Length of the longest prefix of `tokens` present in the tree. Read-only."""
        node, pos = self._root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            common = _common_prefix_len(child.key, tokens, pos)
            pos += common
            if common < len(child.key):
                break
            node = child
        return pos

    # ---- insert --------------------------------------------------------------------------------
    def insert(self, tokens: Sequence[int]) -> None:
        """Add `tokens[:max_tokens]`, mark its path most recently used, then trim to the budget."""
        key = tuple(tokens[:self.max_tokens])
        self._clock += 1
        node, pos = self._root, 0
        node.last_used = self._clock
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                self._add_leaf(node, key[pos:])
                break
            common = _common_prefix_len(child.key, key, pos)
            if common < len(child.key):
                child = self._split(child, common)
            child.last_used = self._clock
            node, pos = child, pos + common
        self._trim_to_budget()

    def _add_leaf(self, parent: _Node, key: tuple[int, ...]) -> None:
        leaf = _Node(serial=next(self._serials), parent=parent, key=key, last_used=self._clock)
        parent.children[key[0]] = leaf
        self._num_tokens += len(key)

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut `node`'s edge after `at` tokens; returns the new upper node. Token count is unchanged.

            parent --key[:at]--> upper --key[at:]--> node (keeps its children)
        """
        assert 0 < at < len(node.key), f"split of a {len(node.key)}-token edge at {at}: match logic broken?"
        parent = node.up()
        upper = _Node(serial=next(self._serials), parent=parent, key=node.key[:at], last_used=node.last_used)
        parent.children[upper.key[0]] = upper
        node.key, node.parent = node.key[at:], upper
        upper.children[node.key[0]] = node
        return upper

    # ---- eviction ------------------------------------------------------------------------------
    def _trim_to_budget(self) -> None:
        """Drop tokens from least-recently-used leaves until `num_tokens <= max_tokens`.

        A leaf is trimmed from its tail when only part of it must go (its prefix stays), otherwise
        removed; a parent left childless becomes a leaf candidate itself. Ties on recency go to the
        older node (smaller serial).
        """
        if self._num_tokens <= self.max_tokens:
            return
        heap = [(n.last_used, n.serial, n) for n in self._nodes() if not n.children]
        heapq.heapify(heap)
        while self._num_tokens > self.max_tokens:
            assert heap, f"{self._num_tokens} tokens over budget {self.max_tokens} with no leaf left: count drifted?"
            _, _, leaf = heapq.heappop(heap)
            excess = self._num_tokens - self.max_tokens
            if excess < len(leaf.key):
                leaf.key = leaf.key[:len(leaf.key) - excess]
                self._num_tokens -= excess
                break
            parent = leaf.up()
            del parent.children[leaf.key[0]]
            self._num_tokens -= len(leaf.key)
            if parent is not self._root and not parent.children:
                heapq.heappush(heap, (parent.last_used, parent.serial, parent))

    # ---- inspection ----------------------------------------------------------------------------
    def _nodes(self) -> list[_Node]:
        """Every node except the root, parents before children."""
        out, stack = [], list(self._root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def snapshot(self) -> tuple[tuple[tuple[int, ...], int], ...]:
        """(token path from the root, last_used) of every node, sorted: equal snapshots mean equal
        trees including recency. For tests and debugging; costs a full walk."""
        paths: dict[int, tuple[int, ...]] = {self._root.serial: ()}
        rows = []
        for node in self._nodes():
            paths[node.serial] = paths[node.up().serial] + node.key
            rows.append((paths[node.serial], node.last_used))
        return tuple(sorted(rows))

    def check_integrity(self) -> None:
        """Shape, filing, recency order and the token count. Costs a full walk."""
        total = 0
        for node in self._nodes():
            parent = node.up()
            assert node.key, f"tree node {node.serial} has an empty edge: trimmed to nothing but not removed?"
            assert parent.children.get(node.key[0]) is node, (
                f"tree node {node.serial} misfiled under its parent: key changed after filing?")
            assert parent is self._root or parent.last_used >= node.last_used, (
                f"tree node {node.serial} used at {node.last_used} after its parent ({parent.last_used}): "
                "insert skipped touching part of its path?")
            total += len(node.key)
        assert total == self._num_tokens, (
            f"edges hold {total} tokens but num_tokens says {self._num_tokens}: split or trim miscounted?")
        assert self._num_tokens <= self.max_tokens, (
            f"{self._num_tokens} tokens over budget {self.max_tokens}: insert returned before trimming?")
