"""Per-request KV bookkeeping and the single release path (DESIGN §3, §4).

A request's page table `pages[i]` holds tokens `[i * page_size, (i + 1) * page_size)`:

    | CACHED: tree pages, locked | PRIVATE: committed  | PRIVATE: allocated, not committed |
    0                 cache_protected_len        kv_committed_len                  kv_allocated_len

    0 <= cache_protected_len <= kv_committed_len <= kv_allocated_len
    cache_protected_len % page_size == 0                      (the tree holds whole pages only)
    len(pages) == ceil(kv_allocated_len / page_size)

Pages below `cache_protected_len` belong to the tree; the request only holds a lock on them. Pages
from `cache_protected_len` on are the request's own and leave only through `free_tail` (shortening),
`drop_behind` (a model whose every layer has a sliding window: pages no later token can see) or
`release` (the end, whatever the reason). A dropped page's slot holds `SCRATCH_PAGE`, which no
kernel reads behind the window; a request with dropped pages offers nothing more to the tree.

    | CACHED | dropped: SCRATCH_PAGE | PRIVATE ...
    0      cpl               cpl + dropped pages

A transfer that reads a request's pages pins every one of them, whoever owns it, until its handle
retires (DESIGN §4 rule 2): `pin_for_transfer` ... `unpin_transfer`, exactly once per handle. The
request's lock alone is not enough: a retracted request drops it while its writes may still read.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kv_store.page_pool import KVOwnershipError, PagePool, PageState
from kv_store.radix_cache import NullPrefixCache, RadixPrefixCache
from kv_store.req_checks import check_manager
from kv_store.tree_node import TreeNode


class ReleaseReason(enum.Enum):
    FINISHED = "finished"
    ABORTED = "aborted"
    RETRACTED = "retracted"
    TIMEOUT = "timeout"
    TRANSFER_FAILED = "transfer_failed"


class ReqKVState(enum.Enum):
    ACTIVE = "active"
    RELEASED = "released"


SCRATCH_PAGE = 0
"""Page 0 of every pool: never allocated (padding rows write it); a dropped page's slot points at it."""


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, eq=False)
class TransferPin:
    """What one transfer handle holds until it retires.

    `own_pages` are the request's pages lent to the handle (IN_FLIGHT); `tree_node` is locked for
    the handle (the cache's root when the transfer reads no cached page), which keeps every page on
    the path root -> `tree_node` CACHED and unevictable, whether or not the request still lives.
    """

    req_id: object
    own_pages: tuple[int, ...]
    tree_node: TreeNode


@dataclass(eq=False)
class ReqKV:
    """KV owned by one request in one pool. Mutated only by `KVManager`."""

    req_id: object
    page_size: int
    locked_node: TreeNode
    pages: list[int] = field(default_factory=list)
    kv_committed_len: int = 0
    kv_allocated_len: int = 0
    state: ReqKVState = ReqKVState.ACTIVE
    dropped: int = 0  # own pages freed behind a sliding window: pages[num_protected_pages:][:dropped]
    _cache_protected_len: int = 0

    @property
    def cache_protected_len(self) -> int:
        return self._cache_protected_len

    @cache_protected_len.setter
    def cache_protected_len(self, num_tokens: int) -> None:
        if num_tokens % self.page_size:
            raise KVOwnershipError(
                f"request {self.req_id!r}: cache_protected_len {num_tokens} is not a multiple of page_size "
                f"{self.page_size}: the tree holds whole pages only (a partial page passed as a prefix hit?)")
        self._cache_protected_len = num_tokens

    @property
    def num_protected_pages(self) -> int:
        return self._cache_protected_len // self.page_size

    def own_pages(self) -> list[int]:
        """Pages this request owns outright: `pages[cache_protected_len / page_size + dropped:]`."""
        return self.pages[self.num_protected_pages + self.dropped:]


class KVManager:
    """Allocates, shortens and releases request KV in one pool + prefix cache.

    Not thread-safe: owned by one scheduler. `live` maps req_id -> ReqKV for every ACTIVE request.
    """

    def __init__(self, pool: PagePool, prefix_cache: RadixPrefixCache | NullPrefixCache):
        assert prefix_cache.pool is pool, "prefix cache built over a different pool"
        self.pool = pool
        self.prefix_cache = prefix_cache
        self.page_size = pool.page_size
        self.live: dict[object, ReqKV] = {}
        self.transfer_pins: dict[object, TransferPin] = {}
        """handle -> what it pins, for every transfer handle not yet retired."""
        self.prefix_pins: dict[object, TreeNode] = {}
        """key -> the tree node a long-lived holder (a session between turns) keeps locked."""
        self.offloaded_pins: dict[object, TreeNode] = {}
        """key -> the tree node such a holder keeps in the tree, free to leave the device (`offload_prefix`)."""

    def open(self, req_id: object) -> ReqKV:
        if req_id in self.live:
            raise KVOwnershipError(f"request {req_id!r} already holds KV: opened twice without release?")
        kv = ReqKV(req_id=req_id, page_size=self.page_size, locked_node=self.prefix_cache.root)
        self.live[req_id] = kv
        return kv

    def try_open(self, req_id: object, num_tokens: int, token_ids: list[int] | None = None,
                 reuse: bool = True) -> ReqKV | None:
        """A new request's KV with pages for `num_tokens` tokens after the longest cached prefix of
        `token_ids` (when given: that prefix is reused and locked unless `reuse` is False, and the
        total is capped at `len(token_ids)`), or None, holding nothing, when the pool cannot supply
        the pages. A failed open is undone here, never by `release`: every release is a real ending
        with a true reason."""
        kv = self.open(req_id)
        if token_ids is None:
            total = num_tokens
        else:
            cached = self.match_prefix(kv, token_ids) if reuse else 0
            total = min(cached + num_tokens, len(token_ids))
        if self.try_allocate(kv, total):
            return kv
        self.prefix_cache.unlock(kv.locked_node)  # try_allocate changed nothing: undo the match alone
        kv.pages, kv.locked_node, kv.state = [], self.prefix_cache.root, ReqKVState.RELEASED
        del self.live[req_id]
        return None

    def match_prefix(self, kv: ReqKV, token_ids: list[int]) -> int:
        """Reuse the longest cached prefix of `token_ids`, leaving at least one token to compute
        (its logits are needed). Locks the matched path. Returns the number of cached tokens."""
        assert kv.kv_allocated_len == 0, f"request {kv.req_id!r}: prefix match after allocation"
        match = self.prefix_cache.match(token_ids, len(token_ids) - 1)
        self.prefix_cache.lock(match.node)
        kv.locked_node = match.node
        kv.pages = list(match.pages)
        kv.cache_protected_len = match.num_tokens
        kv.kv_committed_len = kv.kv_allocated_len = match.num_tokens
        return match.num_tokens

    def try_allocate(self, kv: ReqKV, new_allocated_len: int) -> bool:
        """Grow the reservation to `new_allocated_len` tokens, evicting unlocked cached pages if
        needed. Returns False (and changes nothing) when the pool cannot supply the pages."""
        self._expect_active(kv, "allocate")
        assert new_allocated_len >= kv.kv_allocated_len, "try_allocate cannot shrink: use free_tail"
        need = ceil_div(new_allocated_len, self.page_size) - len(kv.pages)
        if need > self.pool.num_free:
            self.prefix_cache.evict(need - self.pool.num_free)
            if need > self.pool.num_free:
                return False
        kv.pages.extend(self.pool.alloc(need, kv.req_id))
        kv.kv_allocated_len = new_allocated_len
        return True

    def commit(self, kv: ReqKV, kv_committed_len: int) -> None:
        """KV for tokens [0, kv_committed_len) is now valid."""
        assert kv.cache_protected_len <= kv_committed_len <= kv.kv_allocated_len, (
            f"request {kv.req_id!r}: commit {kv_committed_len} outside "
            f"[{kv.cache_protected_len}, {kv.kv_allocated_len}]: wrote KV into unallocated slots?")
        kv.kv_committed_len = kv_committed_len

    def cache_unfinished(self, kv: ReqKV, token_ids: list[int]) -> int:
        """Offer a running request's committed whole pages of `token_ids` (its first tokens) to the
        prefix tree, and protect those the tree took: the request keeps them under its lock on the
        deeper node, as if it had matched them at admission, so a request with the same tokens admitted
        now reuses them. When the tree already holds another copy of the page after its protected
        prefix (in any tier: its KV arrived from elsewhere, or another request computed the same
        tokens meanwhile), nothing is offered. Returns the new `cache_protected_len`.

            | tree's (locked)  | newly the tree's (locked) | own (a duplicate, and after) |
            0                 cpl                        new cpl
        """
        self._expect_active(kv, "cache_unfinished")
        if kv.dropped:  # the tree holds whole prefixes: one with a hole is no prefix
            return kv.cache_protected_len
        ps, first = self.page_size, kv.num_protected_pages
        aligned = min(len(token_ids), kv.kv_committed_len) // ps * ps
        cpl = kv.cache_protected_len
        if aligned <= cpl or self.prefix_cache.cached_len(token_ids[:aligned]) > cpl:
            return cpl  # (the tree has another copy of its next page: it would take the pages after that)
        taken = set(self.prefix_cache.insert(list(token_ids[:aligned]), kv.pages[:aligned // ps], kv.req_id))
        end = first
        while end < aligned // ps and kv.pages[end] in taken:
            end += 1
        if len(taken) != end - first:
            raise KVOwnershipError(f"request {kv.req_id!r}: the tree took pages {sorted(taken)} of its own, not "
                                   f"a run right after its protected prefix (pages {first}..{aligned // ps})")
        if end == first:
            return kv.cache_protected_len
        match = self.prefix_cache.match(token_ids[:end * ps], end * ps)
        if match.num_tokens != end * ps or match.pages != kv.pages[:end]:
            raise KVOwnershipError(f"request {kv.req_id!r}: the tree's path to its {end} cached pages is not its pages")
        self.prefix_cache.lock(match.node)
        self.prefix_cache.unlock(kv.locked_node)
        kv.locked_node, kv.cache_protected_len = match.node, end * ps
        return kv.cache_protected_len

    def free_tail(self, kv: ReqKV, new_len: int) -> list[int]:
        """Shorten the request to `new_len` tokens (spec rejection, retract, session rewind).

        Keeps `ceil(new_len / page_size)` pages, so a page still holding committed tokens is never
        freed; frees `pages[ceil(new_len / ps):]`. Returns the freed pages.
        """
        self._expect_active(kv, "free_tail")
        if not kv.cache_protected_len <= new_len <= kv.kv_allocated_len:
            raise KVOwnershipError(
                f"request {kv.req_id!r}: free_tail to {new_len} outside [{kv.cache_protected_len}, "
                f"{kv.kv_allocated_len}]: would free tree-protected pages or grow the request")
        keep = ceil_div(new_len, self.page_size)
        if keep < kv.num_protected_pages + kv.dropped:
            raise KVOwnershipError(f"request {kv.req_id!r}: free_tail to {new_len} would free pages dropped behind "
                                   "its window already")
        freed = kv.pages[keep:]
        self.pool.free(freed, kv.req_id)
        del kv.pages[keep:]
        kv.kv_allocated_len = new_len
        kv.kv_committed_len = min(kv.kv_committed_len, new_len)
        return freed

    def drop_behind(self, kv: ReqKV, first_visible: int) -> list[int]:
        """Free `kv`'s own pages wholly before token `first_visible` (the first position any of its
        later tokens can see: every layer has a sliding window), oldest first, stopping at a page
        lent out (IN_FLIGHT); their slots become `SCRATCH_PAGE`. Returns the freed pages."""
        self._expect_active(kv, "drop pages behind its window")
        first = kv.num_protected_pages + kv.dropped
        end = first
        while end < min(first_visible // self.page_size, len(kv.pages) - 1) and (
                self.pool.state(kv.pages[end]) is PageState.PRIVATE):
            end += 1
        freed = kv.pages[first:end]
        if freed:
            self.pool.free(freed, kv.req_id)
            kv.pages[first:end] = [SCRATCH_PAGE] * len(freed)
            kv.dropped += len(freed)
        return freed

    def release(self, kv: ReqKV, reason: ReleaseReason, token_ids: list[int], cache: bool = True) -> None:
        """The one way a request's KV ends. Idempotent: a second call is a no-op.

        With `cache`, the committed whole pages go into the prefix tree (it takes those it does not
        hold on device yet; the rest are duplicates and are freed); everything else the request owns
        is freed; the tree lock is dropped. `token_ids` are the request's tokens (at least
        `kv_committed_len` of them when caching).

            | tree's (unlock) | offered to the tree: taken or freed | partial page + uncommitted: free |
            0               cpl                                  aligned                          allocated
        """
        if kv.state is ReqKVState.RELEASED:
            return
        in_flight = self.lent_pages(kv)
        if in_flight:
            raise KVOwnershipError(f"request {kv.req_id!r} released ({reason.value}) while pages {in_flight} are "
                                   "IN_FLIGHT: retire their transfer handles first")
        assert not cache or len(token_ids) >= kv.kv_committed_len, (
            f"request {kv.req_id!r}: release with {len(token_ids)} tokens < kv_committed_len {kv.kv_committed_len}")
        ps = self.page_size
        aligned = kv.kv_committed_len // ps * ps if not kv.dropped else kv.cache_protected_len
        taken = set(self.prefix_cache.insert(list(token_ids[:aligned]), kv.pages[:aligned // ps], kv.req_id)
                    if cache else ())
        self.pool.free([p for p in kv.own_pages() if p not in taken], kv.req_id)
        self.prefix_cache.unlock(kv.locked_node)
        kv.pages, kv.locked_node = [], self.prefix_cache.root
        kv.state = ReqKVState.RELEASED
        del self.live[kv.req_id]

    # ---- transfers -----------------------------------------------------------------------------------
    def pin_for_transfer(self, kv: ReqKV, first_page: int, end_page: int, handle: object) -> object:
        """Pin every page a transfer `handle` reads, `kv.pages[first_page:end_page]`, until
        `unpin_transfer(handle)`. Returns `handle`: it owns the pins now.

            | cached: tree path locked for the handle | own: lent to the handle (IN_FLIGHT) |
            first_page                      num_protected_pages                       end_page

        The lock covers the whole cached prefix `[0, num_protected_pages)` (a lock protects a path,
        and a caller ships pages in order, so `end_page >= num_protected_pages` whenever it reads
        cached pages). Unlike the request's own lock it survives the request's release.
        """
        self._expect_active(kv, "pin for a transfer")
        if handle in self.transfer_pins:
            raise KVOwnershipError(f"transfer handle {handle!r} pinned twice: one handle reused for two writes?")
        if kv.dropped and first_page < kv.num_protected_pages + kv.dropped:
            raise KVOwnershipError(f"request {kv.req_id!r}: transfer of pages from {first_page}, "
                                   "dropped behind its window")
        if not 0 <= first_page < end_page <= len(kv.pages):
            raise KVOwnershipError(f"request {kv.req_id!r}: transfer of pages [{first_page}, {end_page}) outside "
                                   f"its page table of {len(kv.pages)}")
        own = kv.pages[max(first_page, kv.num_protected_pages):end_page]
        if own:
            self.pool.hand_off(own, kv.req_id, handle)
        node = kv.locked_node if first_page < kv.num_protected_pages else self.prefix_cache.root
        self.prefix_cache.lock(node)
        self.transfer_pins[handle] = TransferPin(kv.req_id, tuple(own), node)
        return handle

    def unpin_transfer(self, handle: object) -> list[int]:
        """`handle` is retired (terminal, and no longer reading): drop its tree lock and take back its
        own pages. Returns the pages that came back PRIVATE to their request (none still lent elsewhere)."""
        pin = self.transfer_pins.pop(handle, None)
        if pin is None:
            raise KVOwnershipError(f"transfer handle {handle!r} unpinned but holds no pin: retired twice (a "
                                   "FAILED write retired again once settled?), or never pinned?")
        self.prefix_cache.unlock(pin.tree_node)
        return self.pool.retire(handle) if pin.own_pages else []

    def pin_prefix(self, key: object, node: TreeNode) -> None:
        """Keep the path root -> `node` in the tree and on device for `key` (replacing `key`'s pin)."""
        self.prefix_cache.lock(node)  # before the old pin goes: a path both share never looks unpinned
        if key in self.prefix_pins or key in self.offloaded_pins:
            self.unpin_prefix(key)
        self.prefix_pins[key] = node

    def offload_prefix(self, key: object) -> None:
        """`key`'s pinned path may leave the device: the tier writes it to the host and keeps it there
        (`RadixPrefixCache.pin_host`) until `pin_prefix` or `unpin_prefix`; a match loads it back."""
        node = self.prefix_pins.pop(key, None)
        if node is None:
            raise KVOwnershipError(f"prefix pin {key!r} offloaded while not pinned on device")
        self.prefix_cache.pin_host(node)
        self.prefix_cache.unlock(node)
        self.offloaded_pins[key] = node

    def unpin_prefix(self, key: object) -> None:
        node = self.prefix_pins.pop(key, None)
        if node is not None:
            self.prefix_cache.unlock(node)
            return
        node = self.offloaded_pins.pop(key, None)
        if node is None:
            raise KVOwnershipError(f"prefix pin {key!r} dropped twice, or never taken")
        self.prefix_cache.unpin_host(node)

    def pinned_pages(self, handle: object) -> list[int]:
        """Every page `handle` keeps from moving: its cached path, then its own lent pages."""
        pin = self.transfer_pins[handle]
        return self.prefix_cache.path_pages(pin.tree_node) + list(pin.own_pages)

    def lent_pages(self, kv: ReqKV) -> list[int]:
        """`kv`'s own pages still lent to a transfer or loader (IN_FLIGHT): it cannot be released yet."""
        return [p for p in kv.own_pages() if self.pool.state(p) is PageState.IN_FLIGHT]

    # ---- checks ------------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Pool, tree, transfer pins and every live request agree (DESIGN §3; `req_checks.py`). Raises
        AssertionError naming the cause."""
        check_manager(self)

    def _expect_active(self, kv: ReqKV, action: str) -> None:
        if kv.state is not ReqKVState.ACTIVE:
            raise KVOwnershipError(f"request {kv.req_id!r}: {action} after release (finished/aborted/retracted)")
