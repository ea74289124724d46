"""The prefix tree's records (DESIGN §5): `TreeNode`, one run of whole pages, and `PrefixMatch`, what a
match hands out; `subtree` walks the nodes below a root. The tree itself is `kv_store/radix_cache.py`.

Tiers. A node's `residency` (`kv_store/residency.py`) says where its pages are valid: `pages` are
device (L1) page ids, CACHED(node) in the device pool whenever the node is on device; `host_pages`
are host (L2) page ids, CACHED(node) in the host pool whenever the host copy is valid.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

from kv_store.residency import Residency


@dataclass(eq=False)
class TreeNode:
    id: int
    parent: TreeNode | None  # None only for the root
    key: tuple[int, ...]  # token ids, len == num_pages * page_size
    pages: list[int]  # device page ids; [] when the node is not on device
    children: dict[tuple[int, ...], TreeNode] = field(default_factory=dict)
    lock_ref: int = 0
    host_pins: int = 0  # holders keeping its copy in the tree in some tier, not on device (offloaded sessions)
    last_access: int = 0
    host_pages: list[int] = field(default_factory=list)  # host page ids; [] when the host copy is not valid
    residency: Residency = Residency.DEVICE
    hits: int = 0  # matches that reached this node (the selective write policy counts them)
    in_l3: bool = False  # its pages were written to (or came from) the L3 store
    fetched_from_l3: bool = False  # brought by an L3 prefetch and not loaded to device since (hit accounting)
    l3_keys: list[str] = field(default_factory=list)  # its pages' L3 keys, once computed

    def up(self) -> TreeNode:
        """The parent of a node below the root."""
        assert self.parent is not None, f"tree node {self.id} has no parent: walked past the root, or detached?"
        return self.parent


@dataclass(frozen=True)
class PrefixMatch:
    """Result of `match`: `pages` hold tokens [0, num_tokens); `node` is the deepest matched node."""

    num_tokens: int
    pages: list[int]
    node: TreeNode


class TreeTier(Protocol):
    """The tier below the device that a tree hands its hooks (`radix_cache.L1Only`: none;
    `kv_store/host_cache.py:HostCache`: the host). Called by the tree under the scheduler's thread."""

    def leave_l1(self, node: TreeNode) -> int: ...

    def on_insert(self, node: TreeNode) -> None: ...

    def on_hit(self, node: TreeNode) -> None: ...

    def drain(self) -> bool: ...

    def settle(self, node: TreeNode) -> bool: ...

    def free_host(self, node: TreeNode) -> None: ...

    def retag_host(self, pages: list[int], old_node_id: int, new_node_id: int) -> None: ...

    def holders(self) -> list[TreeNode]: ...

    def device_pages_held(self) -> int: ...

    def check_node(self, node: TreeNode) -> None: ...

    def check_integrity(self) -> None: ...


def subtree(root: TreeNode) -> Iterator[TreeNode]:
    """Every node below `root` (not `root` itself), depth first, lazily."""
    stack = list(root.children.values())
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())
