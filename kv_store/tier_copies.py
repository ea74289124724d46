"""Records of the host tier's copies (DESIGN §5): a backup (`Write`, device -> host) or a load
(`Load`, host -> device) in flight; and `TierCounters`, the tier's cumulative figures (hits, bytes
copied, pages evicted, copy errors).

`kv_store/host_cache.py:HostCache` makes, finishes and counts them on the scheduler's thread. Who holds
what while a copy is in flight (DESIGN §4 rule 2):

    backup (device -> host)   host pages IN_FLIGHT(write); node WRITING, locked by the write (its
                              device pages cannot move); done: host pages CACHED(node), node BOTH
    load (host -> device)     device pages IN_FLIGHT(load); nodes LOADING, deepest locked by the
                              load (their host pages cannot move); done: device pages CACHED(node),
                              nodes BOTH; relocation_version bumped at start and at completion
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.kv_layout import KVCacheTensors
from kv_store.copier import CopyJob
from kv_store.tree_node import TreeNode


@dataclass(eq=False)
class Write:
    """One device -> host backup of `node` into `host_pages`."""

    id: int
    node: TreeNode
    host_pages: list[int]
    job: CopyJob | None = None

    def __hash__(self) -> int:
        return hash(("write", self.id))

    @property
    def copy(self) -> CopyJob:
        """The copy job: submitted right after this record is made."""
        assert self.job is not None, f"{self!r}'s copy read before it was submitted"
        return self.job


@dataclass(eq=False)
class Load:
    """One host -> device copy of a run of nodes; `device_pages[i]` are `nodes[i]`'s new pages."""

    id: int
    nodes: list[TreeNode]
    device_pages: list[list[int]]
    locked: TreeNode
    job: CopyJob | None = None

    def __hash__(self) -> int:
        return hash(("load", self.id))

    @property
    def copy(self) -> CopyJob:
        """The copy job: submitted right after this record is made."""
        assert self.job is not None, f"{self!r}'s copy read before it was submitted"
        return self.job

    @property
    def pages(self) -> tuple[int, ...]:
        """The device pages this load writes."""
        return tuple(p for node_pages in self.device_pages for p in node_pages)


@dataclass
class TierCounters:
    """Cumulative figures of one worker's host tier (`/metrics` reads them)."""

    l2_hit_tokens: int = 0  # tokens loaded back to device for requests, that L2 had kept
    l3_hit_tokens: int = 0  # tokens loaded back to device for requests, that an L3 prefetch had brought
    l1_to_l2_bytes: int = 0
    l1_to_l2_seconds: float = 0.0
    l2_to_l1_bytes: int = 0
    l2_to_l1_seconds: float = 0.0
    l1_evicted_pages: int = 0  # device pages of nodes that left L1 (to L2 or dropped)
    l2_evicted_pages: int = 0
    copy_errors: int = 0
    l2_corrupt: int = 0  # host pages whose checksum failed at load-back (dropped, recomputed)


def host_tensors(like: KVCacheTensors, num_pages: int) -> KVCacheTensors:
    """Host pages in `like`'s layout. Uninitialised: a host page is read only after a copy wrote it."""
    page = like.k[0]
    shape = (num_pages,) + tuple(page.shape[1:])
    pin = torch.cuda.is_available()
    make = lambda: torch.empty(shape, dtype=page.dtype, device="cpu", pin_memory=pin)  # noqa: E731
    return KVCacheTensors([make() for _ in like.k], [make() for _ in like.v])
