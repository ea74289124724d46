"""Owner state of every KV page of one pool (DESIGN §3).

The pool owns page *ids*, not memory: the tensors live beside it (`DevicePool`). Every usable page
(1 .. num_pages-1; page 0 is the padding scratch page) is in exactly one state:

    FREE                  on the free list
    PRIVATE(request)      written or reserved by one request, freed only by that request's release
    CACHED(tree node)     owned by the prefix tree, freed only by eviction
    IN_FLIGHT(handles)    lent to a transfer engine or loader; returns to PRIVATE when the last
                          handle touching it has completed

Transitions are the methods below; each raises `KVOwnershipError` on an illegal move, naming the
likely cause.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field


class KVOwnershipError(RuntimeError):
    """A page moved in a way the ownership rules forbid (double free, free while in flight, ...)."""


class OutOfPages(RuntimeError):
    """`alloc` asked for more pages than are free. Callers evict or retract, then retry."""


class PageState(enum.Enum):
    FREE = "free"
    PRIVATE = "private"
    CACHED = "cached"
    IN_FLIGHT = "in_flight"
    SCRATCH = "scratch"  # page 0 only: padding writes land here; never allocated


SCRATCH_PAGE = 0


@dataclass(frozen=True)
class PoolUsage:
    """Page counts by state; `total` excludes the scratch page."""

    total: int
    free: int
    private: int
    cached: int
    in_flight: int


@dataclass
class _InFlight:
    owner: object
    handles: set = field(default_factory=set)


class PagePool:
    """Page-id allocator with one explicit owner state per page.

    Not thread-safe: one scheduler thread owns it. Page ids come out of `alloc` in free-list order
    (initially ascending), so tests can assert exact ids.
    """

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages}: need the scratch page 0 plus at least one usable page")
        if page_size < 1 or page_size & (page_size - 1):
            raise ValueError(f"page_size={page_size} must be a power of two (1, 2, 4, 8, 16, ...)")
        self.num_pages = num_pages
        self.page_size = page_size
        self._state = [PageState.FREE] * num_pages
        self._owner: list[object] = [None] * num_pages
        self._state[SCRATCH_PAGE] = PageState.SCRATCH
        self._counts = {s: 0 for s in PageState}  # pages per state, kept by `_move`: usage() is O(1)
        self._counts[PageState.FREE] = num_pages - 1
        self._free: deque[int] = deque(range(1, num_pages))
        self._in_flight: dict[int, _InFlight] = {}

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def state(self, page: int) -> PageState:
        self._check_id(page)
        return self._state[page]

    def owner(self, page: int) -> object:
        """The request id (PRIVATE / IN_FLIGHT) or tree node id (CACHED) owning `page`."""
        self._check_id(page)
        if self._state[page] is PageState.IN_FLIGHT:
            return self._in_flight[page].owner
        return self._owner[page]

    def handles(self, page: int) -> frozenset:
        """The handles `page` is lent to (empty unless IN_FLIGHT)."""
        self._check_id(page)
        entry = self._in_flight.get(page)
        return frozenset(entry.handles) if entry is not None else frozenset()

    def usage(self) -> PoolUsage:
        c = self._counts  # SCRATCH counted nowhere: total excludes page 0
        return PoolUsage(self.num_usable, c[PageState.FREE], c[PageState.PRIVATE], c[PageState.CACHED],
                         c[PageState.IN_FLIGHT])

    # ---- FREE <-> PRIVATE ----------------------------------------------------------------------
    def alloc(self, num_pages: int, owner: object) -> list[int]:
        """Take `num_pages` FREE pages for `owner` (-> PRIVATE). Raises `OutOfPages`; takes nothing then."""
        if num_pages > len(self._free):
            raise OutOfPages(f"asked for {num_pages} pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(num_pages)]
        for p in pages:
            assert self._state[p] is PageState.FREE, f"page {p} on the free list but {self._state[p]}"
            self._move(p, PageState.PRIVATE)
            self._owner[p] = owner
        return pages

    def free(self, pages: list[int], owner: object) -> None:
        """PRIVATE(owner) -> FREE. Validates every page before changing any."""
        for p in pages:
            self._expect(p, PageState.PRIVATE, owner, "free")
        if len(set(pages)) != len(pages):
            raise KVOwnershipError(f"pages {pages} freed twice in one call: a page table lists a page twice?")
        for p in pages:
            self._move(p, PageState.FREE)
            self._owner[p] = None
            self._free.append(p)

    # ---- PRIVATE <-> CACHED --------------------------------------------------------------------
    def give_to_tree(self, pages: list[int], owner: object, node_id: int) -> None:
        """PRIVATE(owner) -> CACHED(node_id): the prefix tree owns these pages now."""
        for p in pages:
            self._expect(p, PageState.PRIVATE, owner, "insert into the prefix tree")
        for p in pages:
            self._move(p, PageState.CACHED)
            self._owner[p] = node_id

    def retag_cached(self, pages: list[int], old_node_id: int, new_node_id: int) -> None:
        """CACHED(old) -> CACHED(new), when a tree node splits."""
        for p in pages:
            self._expect(p, PageState.CACHED, old_node_id, "move between tree nodes")
            self._owner[p] = new_node_id

    def evict(self, pages: list[int], node_id: int) -> None:
        """CACHED(node_id) -> FREE; only the prefix tree's eviction calls this."""
        for p in pages:
            self._expect(p, PageState.CACHED, node_id, "evict")
        for p in pages:
            self._move(p, PageState.FREE)
            self._owner[p] = None
            self._free.append(p)

    # ---- PRIVATE <-> IN_FLIGHT -----------------------------------------------------------------
    def hand_off(self, pages: list[int], owner: object, handle: object) -> object:
        """Lend PRIVATE(owner) pages to a transfer/load `handle` (-> IN_FLIGHT).

        A page already IN_FLIGHT for the same owner gains one more handle. Returns `handle`: the
        engine owns these pages until `retire(handle)` is called on its completion event.
        """
        for p in pages:
            st = self._state[p] if 0 < p < self.num_pages else None
            if st is PageState.IN_FLIGHT and self._in_flight[p].owner == owner:
                continue
            self._expect(p, PageState.PRIVATE, owner, "hand to a transfer")
        for p in pages:
            if self._state[p] is PageState.PRIVATE:
                self._in_flight[p] = _InFlight(owner=self._owner[p])
                self._move(p, PageState.IN_FLIGHT)
                self._owner[p] = None
            self._in_flight[p].handles.add(handle)
        return handle

    def retire(self, handle: object) -> list[int]:
        """The completion event of `handle` was observed: its pages with no other handle return to
        PRIVATE(owner). Returns the pages that came back. Retiring an unknown handle raises."""
        touched = [p for p, f in self._in_flight.items() if handle in f.handles]
        if not touched:
            raise KVOwnershipError(f"handle {handle!r} retired but touches no IN_FLIGHT page: retired twice?")
        back = []
        for p in touched:
            entry = self._in_flight[p]
            entry.handles.discard(handle)
            if not entry.handles:
                del self._in_flight[p]
                self._move(p, PageState.PRIVATE)
                self._owner[p] = entry.owner
                back.append(p)
        return back

    # ---- checks --------------------------------------------------------------------------------
    def check_integrity(self) -> PoolUsage:
        """Every page in exactly one state; free list == FREE pages; counts add up."""
        free_set = set(self._free)
        assert len(free_set) == len(self._free), "a page is on the free list twice: double free slipped past free()?"
        assert SCRATCH_PAGE not in free_set, "scratch page 0 on the free list"
        for p in range(1, self.num_pages):
            st = self._state[p]
            assert (st is PageState.FREE) == (p in free_set), f"page {p} is {st} but free-list membership disagrees"
            assert (st is PageState.IN_FLIGHT) == (p in self._in_flight), \
                f"page {p} is {st} but in-flight table disagrees"
            if st in (PageState.PRIVATE, PageState.CACHED):
                assert self._owner[p] is not None, f"page {p} is {st} with no owner"
            if st is PageState.IN_FLIGHT:
                assert self._in_flight[p].handles, f"page {p} IN_FLIGHT with no handle: retire() bookkeeping broken"
        counted = {s: 0 for s in PageState}
        for st in self._state[1:]:
            counted[st] += 1
        assert counted == self._counts, f"page counts kept {self._counts} but counted {counted}"
        u = self.usage()
        assert u.free + u.private + u.cached + u.in_flight == u.total, f"page counts do not add up: {u}"
        return u

    # ---- helpers -------------------------------------------------------------------------------
    def _move(self, page: int, state: PageState) -> None:
        self._counts[self._state[page]] -= 1
        self._counts[state] += 1
        self._state[page] = state

    def _check_id(self, page: int) -> None:
        if not 0 < page < self.num_pages:
            what = "the scratch page" if page == SCRATCH_PAGE else "out of range"
            raise KVOwnershipError(f"page {page} is {what} (pool has pages 1..{self.num_pages - 1})")

    def _expect(self, page: int, want: PageState, owner: object, action: str) -> None:
        self._check_id(page)
        st = self._state[page]
        if st is want and self._owner[page] == owner:
            return
        if st is PageState.FREE:
            cause = "freed twice: released after retract or abort?" if action == "free" else "is FREE"
            raise KVOwnershipError(f"page {page} {cause} (tried to {action} for {owner!r})")
        if st is PageState.IN_FLIGHT:
            handles = sorted(map(repr, self._in_flight[page].handles))
            raise KVOwnershipError(f"page {page} is IN_FLIGHT (handles {handles}): cannot {action} before its "
                                   "completion event was observed")
        if st is PageState.CACHED and want is PageState.PRIVATE:
            raise KVOwnershipError(f"page {page} is owned by the prefix tree (node {self._owner[page]}): cannot "
                                   f"{action} it for request {owner!r}; tree pages leave only by eviction")
        raise KVOwnershipError(f"page {page} is {st.value} owned by {self._owner[page]!r}, not {want.value} owned by "
                               f"{owner!r}: cannot {action}")
