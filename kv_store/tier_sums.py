"""Checksums of the host tier's pages across the copies between device and host (docs/design.md §10).

Each host page a backup wrote has the digest of the device page it copied (`PageDigest`, the same
sum the prefill -> decode transfer uses, computed on each pool's own device):

    backup lands      the host pages are digested and compared with their device pages: a copy
                      that differs is a failed backup (the node stays on device only, nothing of
                      it goes to L3); the host digests are kept
    load-back starts  the host pages are compared with what was kept: bytes changed at rest, and
                      the node and what lies below it leave the tree (`l2_eviction.corrupt_copy`)
    load-back lands   the device pages are compared with the host pages' digests: a copy that
                      differs is a failed load (the request computes those tokens; the host copy,
                      checked a moment ago, stays)

A host page an L3 prefetch filled has no digest kept (its value's CRC-32 was checked as it arrived):
its load-back compares the device pages with the host pages digested then.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from kernels.kv_layout import KVCacheTensors
from kv_store.tier_copies import Load, TierCounters
from kv_store.transfer.page_digest import PageDigest
from kv_store.tree_node import TreeNode

log = logging.getLogger(__name__)


class TierSums:
    """The digests of one host tier's pages, and the checks above. Owned by the scheduler's thread."""

    def __init__(self, device_kv: KVCacheTensors, host_kv: KVCacheTensors) -> None:
        self.device, self.host = PageDigest(device_kv), PageDigest(host_kv)
        self.kept: dict[int, int] = {}  # host page -> digest of what its backup copied
        # on a GPU, digests of device pages run on a stream of their own: they read pages no forward
        # writes (a tree node's, or a load's once its copy is done), and must not wait for the step
        gpu = self.device.device.type == "cuda"
        self._side = torch.cuda.Stream(self.device.device) if gpu else None

    def backup_differs(self, node: TreeNode, host_pages: list[int], counters: TierCounters) -> bool:
        """A backup of tree node `node`'s device pages into `host_pages` landed: whether a host page
        differs from its source (counted in `counters.l2_corrupt`, logged); if none, their digests
        are kept."""
        want, got = self._device_digests(node.pages), self.host.digests(host_pages)
        bad = [h for h, w, g in zip(host_pages, want, got) if w != g]
        if not bad:
            self.kept.update(zip(host_pages, got))
            return False
        counters.l2_corrupt += len(bad)
        log.error("tree node %d: host page(s) %s differ from the device pages their backup copied; the node stays "
                  "on device only", node.id, bad)
        return True

    def changed_at_rest(self, host_pages: list[int]) -> list[int]:
        """The host pages whose bytes no longer have the digest their backup kept."""
        kept = [p for p in host_pages if p in self.kept]
        return [p for p, d in zip(kept, self.host.digests(kept)) if d != self.kept[p]]

    def load_differs(self, load: Load, counters: TierCounters) -> bool:
        """`load` (a `tier_copies.Load`: its nodes' host pages into its device pages) landed: whether
        a device page differs from its host page (counted in `counters.l2_corrupt`, logged)."""
        host_pages = [p for node in load.nodes for p in node.host_pages]
        device_pages = [p for pages in load.device_pages for p in pages]
        unkept = [p for p in host_pages if p not in self.kept]
        fresh = dict(zip(unkept, self.host.digests(unkept)))
        want = [self.kept.get(p, fresh.get(p)) for p in host_pages]
        bad = [d for d, w, g in zip(device_pages, want, self._device_digests(device_pages)) if w != g]
        if bad:
            counters.l2_corrupt += len(bad)
            log.error("device page(s) %s differ from the host pages loaded into them; the load fails and its tokens "
                      "are computed again", bad)
        return bool(bad)

    def _device_digests(self, pages: list[int]) -> list[int]:
        with torch.cuda.stream(self._side) if self._side is not None else contextlib.nullcontext():
            return self.device.digests(pages)

    def forget(self, host_pages: list[int]) -> None:
        for page in host_pages:
            self.kept.pop(page, None)

    def damage(self, host_page: int) -> None:
        """Change a word of `host_page` (fault injection: `common/chaos.py`'s l2 site)."""
        self.host.damage(host_page)
