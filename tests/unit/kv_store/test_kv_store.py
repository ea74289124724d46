"""Page pool, radix prefix cache and the release path, without a model."""

import pytest

from kv_store.kv_manager import KVManager, ReleaseReason
from kv_store.page_pool import KVOwnershipError, OutOfPages, PagePool, PageState
from kv_store.radix_cache import NullPrefixCache, RadixPrefixCache


def make_kv(num_pages=11, page_size=4, cache=True) -> KVManager:
    pool = PagePool(num_pages=num_pages, page_size=page_size)
    return KVManager(pool, RadixPrefixCache(pool) if cache else NullPrefixCache(pool))


def finish_cached(kvm: KVManager, req_id: str, toks: list[int]) -> None:
    """Run a request holding `toks` to the end, caching its KV in the tree."""
    r = kvm.open(req_id)
    assert kvm.try_allocate(r, len(toks))
    kvm.commit(r, len(toks))
    kvm.release(r, ReleaseReason.FINISHED, toks)


@pytest.fixture
def kvm():
    m = make_kv()
    yield m
    m.check_integrity()


def test_alloc_in_order_and_page_zero_never_handed_out(kvm):
    a = kvm.open("a")
    assert kvm.try_allocate(a, 9)
    assert a.pages == [1, 2, 3]
    b = kvm.open("b")
    assert kvm.try_allocate(b, 28)  # 7 pages: 3 + 7 = all 10 usable
    assert 0 not in b.pages and kvm.pool.num_free == 0
    assert not kvm.try_allocate(b, 29)  # no page left, nothing cached to evict
    assert len(b.pages) == 7 and b.kv_allocated_len == 28
    kvm.release(a, ReleaseReason.ABORTED, [], cache=False)
    kvm.release(b, ReleaseReason.ABORTED, [], cache=False)
    assert kvm.pool.num_free == 10


def test_double_free_names_the_cause():
    pool = PagePool(num_pages=5, page_size=1)
    pages = pool.alloc(2, "r")
    pool.free(pages, "r")
    with pytest.raises(KVOwnershipError, match=r"page 1 freed twice: released after retract"):
        pool.free([1], "r")
    pool.check_integrity()


def test_free_in_flight_page_raises_until_retired():
    pool = PagePool(num_pages=5, page_size=4)
    pages = pool.alloc(2, "r")
    handle = pool.hand_off(pages, "r", "xfer-7")
    assert pool.state(pages[0]) is PageState.IN_FLIGHT
    with pytest.raises(KVOwnershipError, match=r"IN_FLIGHT.*xfer-7.*completion event"):
        pool.free(pages, "r")
    assert pool.retire(handle) == pages
    with pytest.raises(KVOwnershipError, match="retired twice"):
        pool.retire(handle)
    pool.free(pages, "r")
    assert pool.check_integrity().free == 4


def test_page_returns_only_when_every_handle_retired():
    pool = PagePool(num_pages=4, page_size=2)
    pages = pool.alloc(2, "r")
    pool.hand_off(pages, "r", "h1")
    pool.hand_off(pages[:1], "r", "h2")
    assert pool.retire("h1") == [pages[1]]
    assert pool.state(pages[0]) is PageState.IN_FLIGHT
    assert pool.retire("h2") == [pages[0]]
    pool.free(pages, "r")
    pool.check_integrity()


def test_release_while_in_flight_raises_and_changes_nothing(kvm):
    a = kvm.open("a")
    kvm.try_allocate(a, 8)
    kvm.pool.hand_off(a.pages[1:], "a", "h")
    with pytest.raises(KVOwnershipError, match=r"IN_FLIGHT: retire"):
        kvm.release(a, ReleaseReason.ABORTED, [0] * 8)
    kvm.check_integrity()
    kvm.pool.retire("h")
    kvm.release(a, ReleaseReason.ABORTED, [0] * 8, cache=False)


def test_unaligned_protected_length_raises(kvm):
    a = kvm.open("a")
    with pytest.raises(KVOwnershipError, match=r"cache_protected_len 6 is not a multiple of page_size 4"):
        a.cache_protected_len = 6
    a._cache_protected_len = 6  # bypassing the setter is caught by the integrity check
    with pytest.raises(AssertionError, match="not page-aligned"):
        kvm.check_integrity()
    a._cache_protected_len = 0
    kvm.release(a, ReleaseReason.ABORTED, [])


def test_release_is_idempotent_and_caches_whole_pages(kvm):
    toks = list(range(100, 110))  # 10 tokens = 2 full pages + 2
    a = kvm.open("a")
    kvm.try_allocate(a, 11)
    kvm.commit(a, 10)
    assert a.pages == [1, 2, 3]
    kvm.release(a, ReleaseReason.FINISHED, toks)
    kvm.release(a, ReleaseReason.FINISHED, toks)  # no-op
    assert kvm.pool.state(1) is PageState.CACHED and kvm.pool.state(2) is PageState.CACHED
    assert kvm.pool.state(3) is PageState.FREE  # partial page freed, not cached
    b = kvm.open("b")
    assert kvm.match_prefix(b, toks + [7]) == 8
    assert b.pages == [1, 2] and b.cache_protected_len == 8
    kvm.check_integrity()
    kvm.release(b, ReleaseReason.FINISHED, toks[:8])


def test_match_leaves_one_token_to_compute(kvm):
    toks = list(range(8))
    finish_cached(kvm, "a", toks)
    b = kvm.open("b")
    assert kvm.match_prefix(b, toks) == 4  # 8 cached, but the last token must be recomputed
    kvm.release(b, ReleaseReason.ABORTED, toks)


def test_cached_len_counts_whole_pages_held_without_touching_the_tree(kvm):
    finish_cached(kvm, "a", list(range(12)))
    finish_cached(kvm, "b", list(range(8)) + [50, 51, 52, 53])  # splits a's node after two pages
    tree = kvm.prefix_cache
    before = [(n.id, n.key, n.last_access, n.hits) for n in tree.nodes()]
    assert tree.cached_len(list(range(14))) == 12 and tree.cached_len(list(range(11))) == 8
    assert tree.cached_len(list(range(6)) + [9, 9]) == 4  # diverges inside the second page
    assert tree.cached_len(list(range(8)) + [50, 51, 52, 53, 1]) == 12 and tree.cached_len([9] * 8) == 0
    assert [(n.id, n.key, n.last_access, n.hits) for n in tree.nodes()] == before
    assert NullPrefixCache(kvm.pool).cached_len(list(range(12))) == 0


def test_duplicate_insert_frees_private_copy(kvm):
    toks = list(range(8))
    a, b = kvm.open("a"), kvm.open("b")
    for r in (a, b):
        kvm.try_allocate(r, 8)
        kvm.commit(r, 8)
    kvm.release(a, ReleaseReason.FINISHED, toks)
    kvm.release(b, ReleaseReason.FINISHED, toks)
    assert kvm.prefix_cache.cached_pages() == 2
    assert kvm.pool.usage().free == 8


def test_free_tail_keeps_partial_page_and_refuses_protected(kvm):
    toks = list(range(8))
    finish_cached(kvm, "a", toks)
    b = kvm.open("b")
    kvm.match_prefix(b, toks + [9, 9])  # protects 8
    kvm.try_allocate(b, 15)
    kvm.commit(b, 10)
    assert kvm.free_tail(b, 13) == []  # ceil(13/4) = 4 pages still needed
    fourth = b.pages[3]
    assert kvm.free_tail(b, 9) == [fourth]
    assert kvm.pool.state(fourth) is PageState.FREE
    assert len(b.pages) == 3 and b.kv_allocated_len == 9 and b.kv_committed_len == 9
    with pytest.raises(KVOwnershipError, match="tree-protected"):
        kvm.free_tail(b, 7)
    kvm.release(b, ReleaseReason.RETRACTED, toks + [9])


def test_lru_eviction_spares_locked_and_recent(kvm):
    seqs = {name: [i * 10 + k for k in range(8)] for i, name in enumerate("abc")}
    for name, toks in seqs.items():
        finish_cached(kvm, name, toks)
    holder = kvm.open("hold")
    assert kvm.match_prefix(holder, seqs["a"] + [1]) == 8  # locks a, and touches it (most recent)
    kvm.prefix_cache.match(seqs["b"], 8)  # touch b: c is now least recently used
    c_pages = kvm.prefix_cache.match(seqs["c"], 8).pages
    kvm.prefix_cache.match(seqs["b"], 8)  # touch b again: c is the least recently used leaf
    assert kvm.prefix_cache.evict(1) == 1  # only the tail page of c
    assert [kvm.pool.state(p) for p in c_pages] == [PageState.CACHED, PageState.FREE]
    kvm.prefix_cache.match(seqs["b"], 8)
    assert kvm.prefix_cache.evict(1) == 1
    assert kvm.prefix_cache.match(seqs["c"], 8).num_tokens == 0
    assert kvm.prefix_cache.match(seqs["b"], 8).num_tokens == 8
    assert kvm.prefix_cache.evict(100) == 2  # only b; a is locked
    assert kvm.prefix_cache.match(seqs["a"], 8).num_tokens == 8
    kvm.release(holder, ReleaseReason.FINISHED, seqs["a"] + [1])
    assert kvm.prefix_cache.evict(100) == 2
    assert kvm.pool.num_free == kvm.pool.num_usable


def test_split_keeps_locks_consistent(kvm):
    long = list(range(12))
    finish_cached(kvm, "a", long)
    b = kvm.open("b")
    assert kvm.match_prefix(b, long[:4] + [99, 98, 97]) == 4  # splits the 3-page node after page 1
    kvm.check_integrity()
    c = kvm.open("c")
    assert kvm.match_prefix(c, long + [5]) == 12
    kvm.check_integrity()
    assert kvm.prefix_cache.evict(100) == 0  # everything locked
    kvm.release(b, ReleaseReason.ABORTED, long[:4])
    kvm.release(c, ReleaseReason.ABORTED, long)
    assert kvm.prefix_cache.evict(100) == 3


def test_allocation_evicts_unlocked_cache():
    kvm = make_kv(num_pages=5, page_size=2)
    a = kvm.open("a")
    kvm.try_allocate(a, 8)
    kvm.commit(a, 8)
    kvm.release(a, ReleaseReason.FINISHED, list(range(8)))
    assert kvm.pool.num_free == 0
    b = kvm.open("b")
    assert kvm.try_allocate(b, 6)
    assert kvm.prefix_cache.cached_pages() == 1
    kvm.check_integrity()
    kvm.release(b, ReleaseReason.ABORTED, [], cache=False)
    kvm.check_integrity()


def test_null_prefix_cache_frees_everything():
    kvm = make_kv(cache=False)
    a = kvm.open("a")
    kvm.try_allocate(a, 8)
    kvm.commit(a, 8)
    kvm.release(a, ReleaseReason.FINISHED, list(range(8)))
    b = kvm.open("b")
    assert kvm.match_prefix(b, list(range(9))) == 0
    assert kvm.pool.num_free == kvm.pool.num_usable
    kvm.release(b, ReleaseReason.FINISHED, [])
    kvm.check_integrity()


def test_leak_is_detected(kvm):
    a = kvm.open("a")
    kvm.try_allocate(a, 4)
    del kvm.live["a"]  # a request that vanished without release()
    with pytest.raises(AssertionError, match="leaked"):
        kvm.check_integrity()
    kvm.live["a"] = a
    kvm.release(a, ReleaseReason.ABORTED, [])


def test_bad_pool_shapes():
    with pytest.raises(ValueError, match="power of two"):
        PagePool(num_pages=8, page_size=3)
    with pytest.raises(ValueError, match="scratch page"):
        PagePool(num_pages=1, page_size=4)
    with pytest.raises(OutOfPages):
        PagePool(num_pages=3, page_size=1).alloc(3, "r")


def test_transfer_pin_keeps_cached_pages_after_the_request_is_released(kvm):
    toks = list(range(100, 108))
    finish_cached(kvm, "a", toks)  # pages 1, 2 cached
    b = kvm.open("b")
    assert kvm.match_prefix(b, toks + [7, 7, 7]) == 8
    assert kvm.try_allocate(b, 11) and b.pages == [1, 2, 3]
    kvm.commit(b, 11)
    assert kvm.pin_for_transfer(b, 0, 2, "w-cached") == "w-cached"  # reads cached pages only
    kvm.pin_for_transfer(b, 2, 3, "w-own")
    assert kvm.pinned_pages("w-cached") == [1, 2] and kvm.pinned_pages("w-own") == [3]
    assert kvm.pool.state(3) is PageState.IN_FLIGHT and kvm.lent_pages(b) == [3]
    kvm.check_integrity()
    assert kvm.unpin_transfer("w-own") == [3]
    kvm.release(b, ReleaseReason.RETRACTED, toks + [7, 7, 7])  # b's own lock is gone; the pin is not
    kvm.check_integrity()
    assert [kvm.pool.state(p) for p in (1, 2)] == [PageState.CACHED, PageState.CACHED]
    assert kvm.prefix_cache.evict(100) == 0
    c = kvm.open("c")
    assert not kvm.try_allocate(c, 4 * 9)  # 9 pages: only 8 free, the pinned 2 cannot be evicted
    assert kvm.try_allocate(c, 4 * 8) and not {1, 2} & set(c.pages)
    kvm.release(c, ReleaseReason.ABORTED, [], cache=False)
    assert kvm.unpin_transfer("w-cached") == []
    with pytest.raises(KVOwnershipError, match=r"transfer handle 'w-cached' unpinned but holds no pin: retired twice"):
        kvm.unpin_transfer("w-cached")
    assert kvm.prefix_cache.evict(100) == 2 and kvm.pool.num_free == kvm.pool.num_usable


def test_transfer_pin_bookkeeping_errors_name_the_cause(kvm):
    toks = list(range(8))
    finish_cached(kvm, "a", toks)
    b = kvm.open("b")
    kvm.match_prefix(b, toks + [5])
    kvm.try_allocate(b, 9)
    kvm.pin_for_transfer(b, 0, 2, "w")
    with pytest.raises(KVOwnershipError, match="pinned twice: one handle reused"):
        kvm.pin_for_transfer(b, 2, 3, "w")
    with pytest.raises(KVOwnershipError, match=r"pages \[2, 4\) outside its page table of 3"):
        kvm.pin_for_transfer(b, 2, 4, "w2")
    pin = kvm.transfer_pins.pop("w")  # a handle forgotten without unpin: its lock would leak
    with pytest.raises(AssertionError, match="transfer pins.*skipped unlock"):
        kvm.check_integrity()
    kvm.transfer_pins["w"] = pin
    kvm.check_integrity()
    kvm.release(b, ReleaseReason.ABORTED, toks + [5])
    kvm.prefix_cache.unlock(pin.tree_node)  # a pinned node evicted behind the pin's back
    kvm.prefix_cache.evict(100)
    with pytest.raises(AssertionError, match=r"pinned by transfer 'w' is no longer in the tree: evicted while"):
        kvm.check_integrity()
    kvm.transfer_pins.pop("w")


def test_try_open_reuses_the_prefix_and_a_failed_open_leaves_nothing_behind(kvm):
    finish_cached(kvm, "a", list(range(8)))  # 2 cached pages
    b = kvm.try_open("b", 4, list(range(8)) + [90, 91, 92, 93])  # the cached 8 tokens + 4 new, 1 fresh page
    assert b is not None and b.kv_committed_len == 8 and b.kv_allocated_len == 12 and len(b.pages) == 3
    free_before = kvm.pool.num_free  # 7: 10 usable - 2 cached - 1 of b's
    big = kvm.try_open("big", 40, list(range(8)) + list(range(100, 140)))  # matches a's prefix, then no room
    assert big is None and "big" not in kvm.live and kvm.pool.num_free == free_before
    kvm.release(b, ReleaseReason.ABORTED, list(range(8)), cache=False)
    assert kvm.prefix_cache.evictable_pages() == 2, "the failed open left the matched path locked"
    assert kvm.try_open("c", 44) is None and "c" not in kvm.live  # no prefix given: 11 pages > 10


def test_a_running_request_shares_its_whole_prompt_pages_and_keeps_the_rest(kvm):
    """`cache_unfinished`: the committed whole pages enter the tree under the request's lock, a second
    request with the prompt reuses them at once, and each release frees only what it still owns."""
    prompt = list(range(200, 210))  # two whole pages and two tokens
    a = kvm.open("a")
    kvm.try_allocate(a, 11)
    kvm.commit(a, 10)
    own = list(a.pages)
    assert kvm.cache_unfinished(a, prompt) == 8
    assert a.cache_protected_len == 8 and a.own_pages() == own[2:]
    assert [kvm.pool.state(p) for p in own] == [PageState.CACHED, PageState.CACHED, PageState.PRIVATE]
    kvm.check_integrity()
    with pytest.raises(KVOwnershipError, match="tree-protected"):
        kvm.free_tail(a, 7)  # the tree's pages are no longer the request's to free
    b = kvm.open("b")
    assert kvm.match_prefix(b, prompt) == 8 and b.pages == own[:2]
    assert kvm.prefix_cache.evict(100) == 0  # both hold the path locked
    assert kvm.prefix_cache.cached_pages() == 2
    assert kvm.cache_unfinished(a, prompt) == 8  # again: nothing more to share
    kvm.release(a, ReleaseReason.FINISHED, prompt + [5])
    assert kvm.pool.state(own[2]) is PageState.FREE  # the partial page: the request's own to the end
    assert kvm.pool.state(own[0]) is PageState.CACHED
    kvm.check_integrity()
    kvm.release(b, ReleaseReason.ABORTED, prompt)


def test_a_prompt_whose_first_pages_the_tree_holds_another_copy_of_is_not_offered(kvm):
    """b's KV came from elsewhere (a transfer) while the tree held a copy of its first page: offering
    it would let the tree take b's later pages, past a page b does not protect (found by the API fuzz:
    an `n` leader's prompt landed on a decode worker)."""
    a, b = kvm.open("a"), kvm.open("b")
    kvm.try_allocate(a, 4)
    kvm.commit(a, 4)
    assert kvm.cache_unfinished(a, list(range(300, 304))) == 4
    kvm.try_allocate(b, 12)
    kvm.commit(b, 12)
    assert kvm.cache_unfinished(b, list(range(300, 304)) + list(range(500, 508))) == 0
    assert all(kvm.pool.state(p) is PageState.PRIVATE for p in b.pages)
    kvm.check_integrity()
    kvm.release(b, ReleaseReason.FINISHED, list(range(300, 304)) + list(range(500, 508)))
    kvm.release(a, ReleaseReason.FINISHED, list(range(300, 304)))
    kvm.check_integrity()


def test_a_prompt_the_tree_holds_another_copy_of_stays_the_requests_own_from_there(kvm):
    prompt = list(range(300, 312))  # three whole pages
    a, b = kvm.open("a"), kvm.open("b")
    for r in (a, b):
        kvm.try_allocate(r, 12)
        kvm.commit(r, 12)
    assert kvm.cache_unfinished(a, prompt) == 12
    assert kvm.cache_unfinished(b, prompt) == 0  # its first page is a duplicate: nothing shared
    assert all(kvm.pool.state(p) is PageState.PRIVATE for p in b.pages)
    kvm.check_integrity()
    kvm.release(b, ReleaseReason.FINISHED, prompt)  # its duplicates are freed, the tree keeps a's
    kvm.release(a, ReleaseReason.FINISHED, prompt)
    assert kvm.prefix_cache.cached_pages() == 3 and kvm.pool.usage().free == 10 - 3
