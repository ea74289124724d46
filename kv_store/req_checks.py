"""The KV manager's integrity check (`KVManager.check_integrity`, DESIGN §3): pool, prefix tree,
transfer pins and every live request's page table agree. Read-only."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Protocol

from kv_store.page_pool import PagePool, PageState
from kv_store.radix_cache import NullPrefixCache, RadixPrefixCache
from kv_store.tree_node import TreeNode


class _Pin(Protocol):
    """A `kv_manager.TransferPin` as the check reads it (kv_manager calls this module: no import back)."""

    @property
    def req_id(self) -> object: ...

    @property
    def own_pages(self) -> tuple[int, ...]: ...

    @property
    def tree_node(self) -> TreeNode: ...


class _Req(Protocol):
    """A `kv_manager.ReqKV` as the check reads it."""

    @property
    def req_id(self) -> object: ...

    @property
    def state(self) -> enum.Enum: ...

    @property
    def pages(self) -> list[int]: ...

    @property
    def kv_committed_len(self) -> int: ...

    @property
    def kv_allocated_len(self) -> int: ...

    @property
    def cache_protected_len(self) -> int: ...

    @property
    def num_protected_pages(self) -> int: ...

    @property
    def dropped(self) -> int: ...

    @property
    def locked_node(self) -> TreeNode: ...

    def own_pages(self) -> list[int]: ...


class _Manager(Protocol):
    """A `kv_manager.KVManager` as the check reads it."""

    @property
    def pool(self) -> PagePool: ...

    @property
    def page_size(self) -> int: ...

    @property
    def prefix_cache(self) -> RadixPrefixCache | NullPrefixCache: ...

    @property
    def live(self) -> Mapping[object, _Req]: ...

    @property
    def transfer_pins(self) -> Mapping[object, _Pin]: ...

    @property
    def prefix_pins(self) -> Mapping[object, TreeNode]: ...

    @property
    def offloaded_pins(self) -> Mapping[object, TreeNode]: ...


def check_manager(kvm: _Manager) -> None:
    """`kvm`'s (a `kv_manager.KVManager`) pool, tree, transfer pins and live requests agree (DESIGN §3).
    Raises AssertionError naming the cause."""
    kvm.pool.check_integrity()
    locks: dict[int, int] = {}
    holders = [kv.locked_node for kv in kvm.live.values()]
    holders += [pin.tree_node for pin in kvm.transfer_pins.values()]
    holders += list(kvm.prefix_pins.values())
    for key, node in kvm.prefix_pins.items():
        assert kvm.prefix_cache.holds(node) and node.residency.on_device, (
            f"prefix pinned by {key!r} left the device tier (tree node {node.id}): evicted while pinned?")
    host_pins: dict[int, int] = {}
    for key, node in kvm.offloaded_pins.items():
        assert kvm.prefix_cache.holds(node), f"prefix offloaded by {key!r} left the tree (node {node.id})"
        host_pins[node.id] = host_pins.get(node.id, 0) + 1
    for node in holders:
        locks[node.id] = locks.get(node.id, 0) + 1
    for handle, pin in kvm.transfer_pins.items():
        _check_pin(kvm, handle, pin)
    kvm.prefix_cache.check_integrity(locks, host_pins)
    owned = sum(_check_request(kvm, kv) for kv in kvm.live.values())
    loading = kvm.prefix_cache.pages_held_by_tier()
    usage = kvm.pool.usage()
    assert owned + loading == usage.private + usage.in_flight, (
        f"live requests own {owned} pages and loads in flight {loading}, "
        f"but the pool has {usage.private} PRIVATE + {usage.in_flight} IN_FLIGHT: "
        "pages leaked by a request that ended without release()?")


def _check_request(kvm: _Manager, kv: _Req) -> int:
    rid, ps = kv.req_id, kvm.page_size
    assert kv.state.name == "ACTIVE", f"request {rid!r} RELEASED but still live"
    assert kv.cache_protected_len % ps == 0, (
        f"request {rid!r}: cache_protected_len {kv.cache_protected_len} not page-aligned (page_size {ps})")
    assert 0 <= kv.cache_protected_len <= kv.kv_committed_len <= kv.kv_allocated_len, (
        f"request {rid!r}: lengths out of order: protected {kv.cache_protected_len}, committed "
        f"{kv.kv_committed_len}, allocated {kv.kv_allocated_len}")
    assert len(kv.pages) == -(-kv.kv_allocated_len // ps), (
        f"request {rid!r}: {len(kv.pages)} pages for {kv.kv_allocated_len} allocated tokens")
    dropped = range(kv.num_protected_pages, kv.num_protected_pages + kv.dropped)
    for i, p in enumerate(kv.pages):
        if i in dropped:
            assert p == 0, f"request {rid!r} page table slot {i}, dropped behind its window, -> page {p}, not 0"
            continue
        st = kvm.pool.state(p)
        want = (PageState.CACHED,) if i < kv.num_protected_pages else (PageState.PRIVATE, PageState.IN_FLIGHT)
        assert st in want, f"request {rid!r} page table slot {i} -> page {p} is {st.value}, expected {want}"
        if st is not PageState.CACHED:
            assert kvm.pool.owner(p) == rid, f"request {rid!r} lists page {p} owned by {kvm.pool.owner(p)!r}"
    return len(kv.own_pages())


def _check_pin(kvm: _Manager, handle: object, pin: _Pin) -> None:
    assert kvm.prefix_cache.holds(pin.tree_node), (
        f"tree node {pin.tree_node.id} pinned by transfer {handle!r} is no longer in the tree: evicted while "
        "a transfer still reads it?")
    for p in pin.own_pages:
        assert handle in kvm.pool.handles(p) and kvm.pool.owner(p) == pin.req_id, (
            f"page {p} pinned by transfer {handle!r} of request {pin.req_id!r} is {kvm.pool.state(p).value} "
            f"owned by {kvm.pool.owner(p)!r}: returned before the handle retired?")
