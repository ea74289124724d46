"""L2: the host tier of the prefix tree (DESIGN §5) — backups, write-back, LRU eviction, load-back.

`HostCache` attaches to a `RadixPrefixCache` as its tier. It owns a host page pool (same layout as
the device pool, pinned on CUDA) and a `PageCopier`; all bookkeeping runs on the scheduler's thread,
only the byte copies run on the copier's.

The table of who holds what while a copy is in flight (DESIGN §4 rule 2) sits with the records of
those copies and the tier's counters, in `kv_store/tier_copies.py`.

Write policies: `write_through` backs up every node as it enters the tree; `write_through_selective`
once a node has been matched `selective_hits` times; `write_back` only when L1 evicts it. L1 eviction
of a node without a host copy writes it back first (waiting for that copy), then frees its device
pages (-> HOST, relocation_version bumped); with no host page to be had the node is dropped. L2
evicts least recently used: first host copies of nodes still on device (they cost nothing to drop),
then host-only leaves (`kv_store/l2_eviction.py`).

A request whose prefix continues below L1 gets a `LoadTicket` (`start_load`): device pages are
allocated and the copy starts; the request waits in LOADING until `ticket.ready`, then matches again
(now on device). The ticket's lock keeps the loaded nodes on device until the request releases it.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass

from common import chaos
from kernels.kv_layout import KVCacheTensors
from kv_store.copier import Copier, Direction, PageCopier
from kv_store.device_pool import DevicePool
from kv_store.l2_eviction import corrupt_copy, drop_unheld, evict_l2
from kv_store.l3.bridge import L3Bridge, NullBridge
from kv_store.l3.tier import L3Tier, Prefetch
from kv_store.page_pool import PagePool, PageState
from kv_store.radix_cache import RadixPrefixCache
from kv_store.residency import Residency, move_residency
from kv_store.tier_copies import Load, TierCounters, Write
from kv_store.tier_sums import TierSums
from kv_store.tree_node import TreeNode


class WritePolicy(enum.Enum):
    WRITE_THROUGH = "write_through"
    WRITE_THROUGH_SELECTIVE = "write_through_selective"
    WRITE_BACK = "write_back"


@dataclass(eq=False)
class LoadTicket:
    """A request's wait for loads (and an L3 prefetch): `node` (locked for the ticket) is the deepest
    node its loads bring, or where the prefetch will attach."""

    node: TreeNode
    loads: tuple[Load, ...]
    num_tokens: int  # tokens its own loads bring to device (0 when it waits for another request's)
    from_l3: int = 0  # of them, tokens an L3 prefetch brought to the host tier (served from L3)
    prefetch: Prefetch | None = None  # waited for per the L3 prefetch policy


class HostCache:
    """The L2 tier of `tree` (`tree.attach_tier` hands it the tree's hooks). Not thread-safe: owned by
    the scheduler's thread (the copier has its own)."""

    def __init__(self, tree: RadixPrefixCache, device: DevicePool, host_kv: KVCacheTensors,
                 policy: WritePolicy = WritePolicy.WRITE_THROUGH, selective_hits: int = 2, copy_timeout_s: float = 30.0,
                 l3: L3Tier | None = None):
        assert tree.pool is device.pages, "the tree must be over the device pool"
        self.tree, self.device, self.policy = tree, device, policy
        self.selective_hits, self.copy_timeout_s = selective_hits, copy_timeout_s
        self.kv = host_kv
        self.pool = PagePool(host_kv.num_pages, device.kv.page_size)
        self.copier: Copier = PageCopier(device.kv, self.kv)
        self.counters = TierCounters()
        self.l3 = L3Bridge(l3, tree, self.pool, self._host_room) if l3 is not None else NullBridge()
        self._writes: dict[int, Write] = {}
        self._loads: dict[int, Load] = {}
        self._tickets: dict[int, LoadTicket] = {}
        self._ids = itertools.count(1)
        # every copy between device and host checked by its pages' digests (`kv_store/tier_sums.py`)
        self.sums = TierSums(device.kv, host_kv) if host_kv.k[0].device.type == "cpu" else None
        self.failed_loads: set[int] = set()  # ids of nodes whose load-back failed: never tried again

    # ---- tree hooks --------------------------------------------------------------------------------
    def on_insert(self, node: TreeNode) -> None:
        if self.policy is WritePolicy.WRITE_THROUGH:
            self._start_write(node)

    def on_hit(self, node: TreeNode) -> None:
        if (self.policy is WritePolicy.WRITE_THROUGH_SELECTIVE and node.residency is Residency.DEVICE
                and node.hits >= self.selective_hits):
            self._start_write(node)

    def leave_l1(self, node: TreeNode) -> int:
        """`node` (unlocked, nothing of its below it on device) gives up its device pages: kept on the
        host (written back first when it has no host copy), or dropped when the host has no room.
        Returns the device pages freed. A host-pinned node (`TreeNode.host_pins`) is never dropped: with
        no host room it stays on device."""
        if node.residency is Residency.DEVICE and not self._write_back(node):
            if node.residency is Residency.WRITING or node.host_pins:
                return 0  # the copy timed out, or it may not be lost: its pages stay where they are
            freed = self.tree.drop_subtree(node)
            self.counters.l1_evicted_pages += freed
            return freed
        freed = len(node.pages)
        self.device.pages.evict(node.pages, node.id)
        node.pages = []
        node.residency = move_residency(node.residency, Residency.HOST, f"tree node {node.id} evicted from L1")
        self.device.bump_relocation_version()
        self.counters.l1_evicted_pages += freed
        return freed

    def drain(self) -> bool:
        """Wait for the backups in flight (their nodes are locked until then); True when any finished."""
        jobs = [w.copy for w in self._writes.values()]
        deadline = time.monotonic() + self.copy_timeout_s
        for job in jobs:
            job.wait(max(0.0, deadline - time.monotonic()))
        return self._finish_writes() > 0

    def settle(self, node: TreeNode) -> bool:
        """Wait for the copy in flight for `node`, if any, and finish it; False when it did not finish
        in time (the node stays in transit)."""
        if not node.residency.in_transit:
            return True
        job = next((w.copy for w in self._writes.values() if w.node is node), None) or next(
            ld.copy for ld in self._loads.values() if node in ld.nodes)
        if job.wait(self.copy_timeout_s):
            self._finish_copies()  # not L3: a prefetch attaching here would change the tree mid-walk
        return not node.residency.in_transit

    def free_host(self, node: TreeNode) -> None:
        if self.sums is not None:
            self.sums.forget(node.host_pages)
        self.pool.evict(node.host_pages, node.id)
        self.counters.l2_evicted_pages += len(node.host_pages)
        node.host_pages = []

    def retag_host(self, pages: list[int], old_node_id: int, new_node_id: int) -> None:
        self.pool.retag_cached(pages, old_node_id, new_node_id)

    def holders(self) -> list[TreeNode]:
        """Nodes locked by this tier: one per backup, per load, per ticket."""
        return ([w.node for w in self._writes.values()] + [ld.locked for ld in self._loads.values()]
                + [t.node for t in self._tickets.values()])

    def device_pages_held(self) -> int:
        return sum(len(p) for ld in self._loads.values() for p in ld.device_pages)

    # ---- the scheduler's side ------------------------------------------------------------------------
    def start_load(self, token_ids: list[int], max_match_tokens: int, fetch_l3: bool = False,
                   who: str = "") -> LoadTicket | None:
        """When the cached prefix of `token_ids[:max_match_tokens]` continues below L1, a ticket for
        bringing it to device (a new load, or loads already in flight for those nodes); None when
        there is nothing below L1 or no device page for it (the request computes it instead). With
        `fetch_l3` (a request's first look), an L3 prefetch of what follows the local match starts
        too, and the ticket waits for it as the prefetch policy says."""
        pos, path = self.tree.walk(token_ids, max_match_tokens, lambda n: True)
        prefetch = self.l3.start(token_ids, max_match_tokens, pos, path) if fetch_l3 else None
        below = [n for n in path if not n.residency.on_device]
        if not below:
            return self._ticket(path[-1] if path else self.tree.root, (), 0, prefetch) if prefetch else None
        if below[0].residency is Residency.LOADING:
            return self._wait_for_loads(below, prefetch)
        run = list(itertools.takewhile(lambda n: n.residency is Residency.HOST, below))
        self.tree.lock(run[-1])  # no eviction below may take the run while device pages are found
        load, bad = Load(next(self._ids), [], [], locked=run[-1]), None
        for node in run:
            if (bad := corrupt_copy(self, node, who)) is not None:
                break  # it and what lies below it are computed again
            pages = self._alloc_device(len(node.host_pages), load)
            if pages is None:
                break
            load.nodes.append(node)
            load.device_pages.append(pages)
        self.tree.unlock(run[-1])
        drop_unheld(self.tree, bad)
        if not load.nodes:
            return self._ticket(path[-1], (), 0, prefetch) if prefetch else None
        return self._begin_load(load, prefetch)

    def release_ticket(self, ticket: LoadTicket) -> None:
        """The request is done with `ticket` (admitted, or ended): its lock is dropped."""
        del self._tickets[id(ticket)]
        self.tree.unlock(ticket.node)

    def ready(self, ticket: LoadTicket) -> bool:
        if any(ld.id in self._loads for ld in ticket.loads):
            return False
        return ticket.prefetch is None or self.l3.done(ticket.prefetch)

    def poll(self) -> None:
        """Finish every backup, load and prefetch phase whose work is done (never blocks)."""
        self._finish_copies()
        self.l3.poll()

    def _finish_copies(self) -> None:
        self._finish_writes()
        for load in [ld for ld in self._loads.values() if ld.copy.done()]:
            self._finish_load(load)

    def wait_any(self, timeout_s: float) -> None:
        """Block until some copy in flight is done, at most `timeout_s` (nothing else to do meanwhile)."""
        jobs = [w.copy for w in self._writes.values()] + [ld.copy for ld in self._loads.values()]
        if jobs:
            jobs[0].wait(timeout_s)
        else:
            self.l3.wait_any(timeout_s)

    def busy(self) -> bool:
        return bool(self._writes or self._loads) or self.l3.busy()

    def close(self) -> None:
        self.copier.close()
        self.l3.close()

    # ---- checks --------------------------------------------------------------------------------------
    def check_node(self, node: TreeNode) -> None:
        n = self.tree.num_pages(node)
        assert len(node.host_pages) == (n if node.residency.on_host else 0), (
            f"tree node {node.id} is {node.residency.value} with {len(node.host_pages)} host pages for {n} pages")
        for p in node.host_pages:
            assert self.pool.state(p) is PageState.CACHED and self.pool.owner(p) == node.id, (
                f"tree node {node.id} lists host page {p} but the host pool says {self.pool.state(p)} owned by "
                f"{self.pool.owner(p)!r}: freed behind the tree's back?")
        if node.residency.in_transit:
            copying = {w.node for w in self._writes.values()} | {n for ld in self._loads.values() for n in ld.nodes}
            assert node in copying, f"tree node {node.id} is {node.residency.value} but no copy in flight moves it"

    def check_integrity(self) -> None:
        """Host pool consistent; every host page is a node's copy or held by a backup in flight."""
        usage = self.pool.check_integrity()
        cached = sum(len(n.host_pages) for n in self.tree.nodes())
        assert usage.cached == cached, (
            f"host pool has {usage.cached} CACHED pages but tree nodes list {cached}: "
            "a host copy dropped without evict?")
        writing = sum(len(w.host_pages) for w in self._writes.values())
        fetching = self.l3.fetching_pages()
        assert usage.in_flight == writing + fetching and usage.private == 0, (
            f"host pool has {usage.in_flight} IN_FLIGHT + {usage.private} PRIVATE pages, backups in flight hold "
            f"{writing} and prefetches {fetching}: a finished backup or prefetch not retired?")
        for load in self._loads.values():
            for p in (p for pages in load.device_pages for p in pages):
                assert load in self.device.pages.handles(p), f"device page {p} of load {load.id} is not lent to it"

    # ---- helpers ---------------------------------------------------------------------------------------
    def _start_write(self, node: TreeNode) -> Write | None:
        """Back `node` up to the host (async); None when the host has no room (the node stays DEVICE)."""
        num_pages = self.tree.num_pages(node)
        if not self._host_room(num_pages):
            return None
        write = Write(next(self._ids), node, [], job=None)
        write.host_pages = self.pool.alloc(num_pages, write)
        self.pool.hand_off(write.host_pages, write, write)
        self.tree.lock(node)
        node.residency = move_residency(node.residency, Residency.WRITING, f"tree node {node.id} backup")
        write.job = self.copier.submit(Direction.TO_HOST, node.pages, write.host_pages)
        self._writes[write.id] = write
        return write

    def _write_back(self, node: TreeNode) -> bool:
        """Copy `node` (DEVICE) to the host now, waiting for it; True when it is BOTH afterwards."""
        write = self._start_write(node)
        if write is None:
            return False
        if write.copy.wait(self.copy_timeout_s):
            self._finish_write(write)
        return node.residency is Residency.BOTH

    def _finish_writes(self) -> int:
        done = [w for w in self._writes.values() if w.copy.done()]
        for write in done:
            self._finish_write(write)
        return len(done)

    def _finish_write(self, write: Write) -> None:
        del self._writes[write.id]
        node = write.node
        self.tree.unlock(node)
        self.pool.retire(write)
        copied = write.copy.error is None
        if not copied or (self.sums is not None and self.sums.backup_differs(node, write.host_pages, self.counters)):
            self.pool.free(write.host_pages, write)
            self.counters.copy_errors += not copied
            node.residency = move_residency(node.residency, Residency.DEVICE, f"tree node {node.id} backup failed")
            return
        self.pool.give_to_tree(write.host_pages, write, node.id)
        if self.sums is not None and chaos.strike("l2"):  # bytes changed at rest: found at load-back
            self.sums.damage(write.host_pages[0])
        node.host_pages = write.host_pages
        node.residency = move_residency(node.residency, Residency.BOTH, f"tree node {node.id} backed up")
        self.counters.l1_to_l2_bytes += write.copy.num_bytes
        self.counters.l1_to_l2_seconds += write.copy.seconds
        self.l3.write(node)

    def _wait_for_loads(self, below: list[TreeNode], prefetch: Prefetch | None) -> LoadTicket:
        run = list(itertools.takewhile(lambda n: n.residency is Residency.LOADING, below))
        loads = tuple({id(ld): ld for ld in self._loads.values() if any(n in run for n in ld.nodes)}.values())
        return self._ticket(run[-1], loads, 0, prefetch)

    def _begin_load(self, load: Load, prefetch: Prefetch | None) -> LoadTicket:
        src = [p for node in load.nodes for p in node.host_pages]
        dst = [p for pages in load.device_pages for p in pages]
        self.device.pages.hand_off(dst, load, load)
        for node in load.nodes:
            node.residency = move_residency(node.residency, Residency.LOADING, f"tree node {node.id} load")
        load.locked = load.nodes[-1]
        self.tree.lock(load.locked)
        load.job = self.copier.submit(Direction.TO_DEVICE, src, dst)
        self._loads[load.id] = load
        self.device.begin_load(load.job)
        ps = self.pool.page_size
        num_tokens = len(dst) * ps
        from_l3 = sum(len(node.key) for node in load.nodes if node.fetched_from_l3)
        for node in load.nodes:
            node.fetched_from_l3 = False  # served once from L3; kept in L2 from now on
        self.counters.l3_hit_tokens += from_l3
        self.counters.l2_hit_tokens += num_tokens - from_l3
        return self._ticket(load.locked, (load,), num_tokens, prefetch, from_l3)

    def _ticket(self, node: TreeNode, loads: tuple[Load, ...], num_tokens: int,
                prefetch: Prefetch | None = None, from_l3: int = 0) -> LoadTicket:
        ticket = LoadTicket(node, loads, num_tokens, from_l3, self.l3.waited_for(prefetch))
        self.tree.lock(node)
        self._tickets[id(ticket)] = ticket
        return ticket

    def _finish_load(self, load: Load) -> None:
        del self._loads[load.id]
        self.device.end_load(load.copy)
        self.tree.unlock(load.locked)
        self.device.pages.retire(load)
        failed = load.copy.error is not None
        self.counters.copy_errors += failed
        failed = failed or (self.sums is not None and self.sums.load_differs(load, self.counters))
        self.failed_loads.update([load.nodes[0].id] if failed else [])  # the others lie below it
        for node, pages in zip(load.nodes, load.device_pages):
            if failed:
                self.device.pages.free(pages, load)
                node.residency = move_residency(node.residency, Residency.HOST, f"tree node {node.id} load failed")
                continue
            self.device.pages.give_to_tree(pages, load, node.id)
            node.pages = pages
            node.residency = move_residency(node.residency, Residency.BOTH, f"tree node {node.id} loaded")
        self.counters.l2_to_l1_bytes += load.copy.num_bytes
        self.counters.l2_to_l1_seconds += load.copy.seconds
        self.device.bump_relocation_version()

    def _alloc_device(self, num_pages: int, owner: object) -> list[int] | None:
        pool = self.device.pages
        if pool.num_free < num_pages:
            self.tree.evict(num_pages - pool.num_free)
        return pool.alloc(num_pages, owner) if pool.num_free >= num_pages else None

    def _host_room(self, num_pages: int) -> bool:
        """Whether `num_pages` host pages are FREE, after evicting LRU copies for them."""
        if self.pool.num_free < num_pages:
            self.evict(num_pages - self.pool.num_free)
        return self.pool.num_free >= num_pages

    def evict(self, num_pages: int) -> int:
        """Free `num_pages` host pages (fewer if not enough are evictable) in `kv_store/l2_eviction.py`'s
        order: copies of nodes still on device, then unlocked host-only leaves, least recently used
        first each; never the copy of a host-pinned node. Returns the number freed."""
        return evict_l2(self.tree, num_pages, self.free_host)


class NullHostCache:
    """No host tier (turned off, or no prefix cache): nothing is ever below L1."""

    def __init__(self) -> None:
        self.counters = TierCounters()
        self.pool = None
        self.l3 = NullBridge()

    def start_load(self, token_ids: list[int], max_match_tokens: int, fetch_l3: bool = False,
                   who: str = "") -> LoadTicket | None:
        return None

    def release_ticket(self, ticket: LoadTicket) -> None:
        raise AssertionError("a ticket released to a host tier that never gives one out")

    def ready(self, ticket: LoadTicket) -> bool:
        return True

    def poll(self) -> None:
        pass

    def wait_any(self, timeout_s: float) -> None:
        pass

    def busy(self) -> bool:
        return False

    def check_integrity(self) -> None:
        pass

    def close(self) -> None:
        pass
