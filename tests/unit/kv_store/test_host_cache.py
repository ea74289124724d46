"""The L2 host tier under the prefix tree (kv_store/host_cache.py): write policies, write-back on L1
eviction, LRU in L2, load-back with requests waiting in LOADING, retract that offloads. References:
the same model with the hierarchy off (and HF greedy through the engine tests), and the bytes of a
node's device pages before they left L1."""

from __future__ import annotations

import gc
import time
import weakref

import torch

from cluster.worker_host.build import make_worker
from common.config import EngineConfig
from engine.request import RequestStatus
from kv_store.residency import Residency
from kv_store.transfer.local import LocalTransport
from tests.helpers import greedy, make_engine, make_prompts, tiny_models
from tests.step_pair import StepPair


def settle(engine) -> None:
    while engine.busy():
        engine.step()


def nodes(engine):
    return list(engine.kvm.prefix_cache.nodes())


def pages_bytes(kv, pages: list[int]) -> torch.Tensor:
    """K and V of `pages` in every layer: [2 * num_layers, len(pages), page_size, heads, dim]."""
    return torch.stack([t[pages] for t in (*kv.k, *kv.v)])


def test_write_through_backs_every_node_up_with_the_device_bytes():
    engine = make_engine(page_size=4, num_pages=64, host_cache_pages=64)
    engine.generate(make_prompts(3, min_len=20, max_len=30, seed=1), greedy(max_tokens=6))
    settle(engine)
    assert nodes(engine) and all(n.residency is Residency.BOTH for n in nodes(engine))
    for n in nodes(engine):
        assert torch.equal(pages_bytes(engine.kv_cache, n.pages), pages_bytes(engine.host_cache.kv, n.host_pages))
    assert engine.host_cache.counters.l1_to_l2_bytes > 0
    engine.check_integrity()


def test_write_back_copies_only_on_l1_eviction_and_bumps_the_relocation_version():
    engine = make_engine(page_size=4, num_pages=64, host_cache_pages=64, write_policy="write_back")
    [prompt] = make_prompts(1, min_len=33, max_len=33, seed=2)
    engine.generate([prompt], greedy(max_tokens=4))
    settle(engine)
    [node] = nodes(engine)
    assert node.residency is Residency.DEVICE and engine.host_cache.pool.usage().cached == 0
    before, version = pages_bytes(engine.kv_cache, node.pages), engine.device_pool.relocation_version
    assert engine.kvm.prefix_cache.evict(100) == len(before[0])
    assert node.residency is Residency.HOST and not node.pages
    assert torch.equal(pages_bytes(engine.host_cache.kv, node.host_pages), before)
    assert engine.device_pool.relocation_version > version
    assert engine.kvm.pool.num_free == engine.kvm.pool.num_usable
    engine.check_integrity()


def test_selective_write_through_waits_for_the_hits():
    engine = make_engine(page_size=4, num_pages=64, host_cache_pages=64, write_policy="write_through_selective",
                         write_through_hits=2)
    [prompt] = make_prompts(1, min_len=24, max_len=24, seed=3)
    engine.generate([prompt], greedy(max_tokens=1))
    settle(engine)
    residencies = []
    for turn in range(2):
        engine.generate([prompt + [5 + turn]], greedy(max_tokens=1))  # matches the 24-token prefix
        settle(engine)
        [node] = engine.kvm.prefix_cache.walk(prompt, len(prompt), lambda n: True)[1]
        residencies.append(node.residency)
    assert residencies == [Residency.DEVICE, Residency.BOTH]
    engine.check_integrity()


def test_prefix_evicted_from_l1_is_loaded_back_not_recomputed():
    engine = make_engine(page_size=4, num_pages=64, host_cache_pages=128)
    cold = make_engine(page_size=4, num_pages=64, enable_prefix_cache=False)
    [history] = make_prompts(1, min_len=40, max_len=40, seed=4)
    [first] = engine.generate([history], greedy(max_tokens=8))
    settle(engine)
    engine.kvm.prefix_cache.evict(1000)  # L1 empty: the conversation lives in L2 only
    assert all(n.residency is Residency.HOST for n in nodes(engine))
    turn2 = history + first.output_token_ids + [7, 8, 9]
    req = engine.add_request(turn2, greedy(max_tokens=8))
    engine.step()  # a CPU pool's load is done as it starts: admitted and computed in the same step
    assert req.status is RequestStatus.RUNNING and req.kv.kv_committed_len == len(turn2)
    assert "tier_load_done" in req.timings and req.timings["admitted"] >= req.timings["tier_load_done"]
    seen_loading = req.tier.host_hit_tokens > 0
    while req.status is not RequestStatus.FINISHED:
        engine.step()
    [expect] = cold.generate([turn2], greedy(max_tokens=8))
    assert seen_loading and req.output_token_ids == expect.output_token_ids
    aligned = (len(history) + len(first.output_token_ids) - 1) // 4 * 4  # what the first request committed
    assert req.tier.host_hit_tokens == aligned and req.cached_tokens == aligned
    assert req.cached_tiers == (0, aligned, 0)  # what the usage's cached_tokens_details says
    settle(engine)
    engine.check_integrity()
    cold.check_integrity()


def test_lru_in_l2_drops_redundant_copies_before_host_only_prefixes():
    engine = make_engine(page_size=4, num_pages=40, host_cache_pages=1 + 16)
    a, b = make_prompts(2, min_len=32, max_len=32, seed=5)
    engine.generate([a], greedy(max_tokens=1))
    settle(engine)
    engine.kvm.prefix_cache.evict(1000)  # a: HOST only (8 pages of 16)
    engine.generate([b], greedy(max_tokens=1))  # b: 8 pages on device + its backup fills L2
    settle(engine)
    engine.generate([b[:16] + a[:16]], greedy(max_tokens=1))  # one more backup: L2 must make room
    settle(engine)
    by_first = {n.key[:4]: n for n in nodes(engine) if n.parent is engine.kvm.prefix_cache.root}
    assert by_first[tuple(a[:4])].residency is Residency.HOST, "a host-only prefix was dropped before a copy"
    assert by_first[tuple(b[:4])].residency in (Residency.DEVICE, Residency.BOTH)
    engine.check_integrity()


def test_retracted_requests_resume_from_l2_with_unchanged_output():
    prompts = make_prompts(6, min_len=30, max_len=40, seed=6)
    params = greedy(max_tokens=40)
    tight = make_engine(page_size=4, num_pages=1 + 60, chunk_size=32, host_cache_pages=256)
    reference = make_engine(page_size=4, num_pages=512, chunk_size=32, enable_prefix_cache=False)
    got = tight.generate(prompts, params)
    expect = reference.generate(prompts, params)
    assert tight.num_retractions > 0, "the pool was not tight enough to retract"
    assert [r.output_token_ids for r in got] == [r.output_token_ids for r in expect]
    assert tight.host_cache.counters.l2_hit_tokens > 0, "no retracted request resumed from the host tier"
    settle(tight)
    tight.check_integrity()
    reference.check_integrity()


def test_disaggregated_prefill_with_a_small_l1_loads_back_and_matches_colocated():
    """Three conversations interleaved on a prefill worker whose L1 holds about two: later turns find
    their history in L2 and load it; every turn's tokens equal a colocated engine's without cache."""
    ours, _, arch = tiny_models()
    clock = lambda: 0.0  # noqa: E731
    prefill = make_worker("prefill", EngineConfig(page_size=4, num_pages=1 + 40, chunk_size=32, debug_kv=True,
                                         host_cache_pages=256), ours, arch, LocalTransport(), clock=clock)
    decode = make_worker("decode", EngineConfig(page_size=4, num_pages=256, chunk_size=32, debug_kv=True), ours, arch,
                          LocalTransport(), host_pages=128, clock=clock)
    pair = StepPair(prefill, decode)
    colocated = make_engine(page_size=4, num_pages=512, enable_prefix_cache=False)
    histories = make_prompts(3, min_len=60, max_len=60, seed=7)
    for turn in range(3):
        for c, history in enumerate(histories):
            prompt = history + [9] * (turn + 1)
            res = pair.submit(f"c{c}-t{turn}", prompt, greedy(max_tokens=6))
            while pair.busy():
                pair.step()
            [expect] = colocated.generate([prompt], greedy(max_tokens=6))
            assert res.token_ids == expect.output_token_ids, f"conversation {c} turn {turn}"
    counters = prefill.engine.host_cache.counters
    assert counters.l1_evicted_pages > 0 and counters.l2_hit_tokens > 0
    prefill.check_integrity()
    decode.check_integrity()
    colocated.check_integrity()


def test_two_half_loaded_requests_never_wait_for_each_others_pages():
    """L1 of 30 pages; two conversations of 20 pages each, in L2 only. The first loads all of its
    history, the second half of it: the pool is full, the first needs one more page, and only the
    second's ticket holds pages it could get. The queued request must give them up."""
    engine = make_engine(page_size=4, num_pages=1 + 30, chunk_size=64, host_cache_pages=200)
    a, b = make_prompts(2, min_len=80, max_len=80, seed=8)
    for prompt in (a, b):  # each history in two nodes of 10 pages
        engine.generate([prompt[:40]], greedy(max_tokens=1))
        engine.generate([prompt[:80]], greedy(max_tokens=1))
    settle(engine)
    engine.kvm.prefix_cache.evict(1000)
    reqs = [engine.add_request(p + [1, 2, 3, 4], greedy(max_tokens=2)) for p in (a, b)]
    deadline = time.monotonic() + 60  # steps of a stalled engine are fast: bound by time, not by count
    while not all(r.status is RequestStatus.FINISHED for r in reqs) and time.monotonic() < deadline:
        engine.step()
    assert all(r.status is RequestStatus.FINISHED for r in reqs), (
        f"stalled: {[r.status for r in reqs]}, pool {engine.kvm.pool.usage()}")
    assert reqs[0].tier.host_hit_tokens == 80
    settle(engine)
    engine.check_integrity()


def test_an_engine_dropped_without_close_frees_its_pools_and_stops_its_copier():
    engine = make_engine(page_size=4, num_pages=64, host_cache_pages=64)
    engine.generate(make_prompts(2, seed=1), greedy(max_tokens=4))
    settle(engine)
    engine.check_integrity()
    device, host = weakref.ref(engine.kv_cache.k[0]), weakref.ref(engine.host_cache.kv.k[0])
    copier = weakref.ref(engine.host_cache.copier)
    assert engine.host_cache.copier.inline  # a CPU engine's copier has no thread (test_copier: one that has)
    del engine
    gc.collect()
    assert device() is None and host() is None and copier() is None, "the dropped engine's KV was kept alive"


def test_a_host_copy_corrupted_in_l2_is_never_loaded_it_is_computed_again():
    """A byte of a backed-up page changed in host memory (bit rot, a stray write): the load-back's
    checksum check refuses that node and everything below it (dropped from the tree, counted), the
    prefix above it still loads, and the request's tokens are the cold engine's."""
    engine = make_engine(page_size=4, num_pages=64, host_cache_pages=128)
    cold = make_engine(page_size=4, num_pages=64, enable_prefix_cache=False)
    [history] = make_prompts(1, min_len=40, max_len=40, seed=4)
    [first] = engine.generate([history], greedy(max_tokens=8))
    settle(engine)
    turn2 = history + first.output_token_ids + [7, 8, 9]
    engine.generate([history[:20] + [5, 6, 7, 8]], greedy(max_tokens=2))  # the tree splits at 20 tokens
    settle(engine)
    engine.kvm.prefix_cache.evict(1000)
    upper = next(n for n in nodes(engine) if n.parent is engine.kvm.prefix_cache.root)
    lower = next(n for n in nodes(engine) if n.parent is upper and n.key[0] == history[len(upper.key)])
    victim = lower.host_pages[1]
    engine.host_cache.kv.v[-1][victim].view(-1)[5] += 1.0  # one value of one layer of one page
    req = engine.add_request(turn2, greedy(max_tokens=8))
    settle(engine)
    [expect] = cold.generate([turn2], greedy(max_tokens=8))
    assert req.output_token_ids == expect.output_token_ids
    assert engine.host_cache.counters.l2_corrupt == 1
    assert req.tier.host_hit_tokens == len(upper.key)  # the prefix above it came back from L2
    assert lower not in nodes(engine) and victim not in engine.host_cache.sums.kept
    engine.check_integrity()


def _copies_damaged(engine, direction) -> list[int]:
    """From now on every copy of `engine`'s host tier in `direction` lands with one word of its first
    destination page changed after the copy (a copy engine writing wrong bytes no error reports);
    returns the list the damaged pages are appended to."""
    from kv_store.copier import Direction

    tier, damaged = engine.host_cache, []
    submit = tier.copier.submit

    def damaging(how, src, dst):
        job = submit(how, src, dst)
        assert job.wait(30)
        if how is direction:
            kv = tier.kv if direction is Direction.TO_HOST else tier.device.kv
            kv.k[0][dst[0]].view(-1)[3] += 1.0
            damaged.append(dst[0])
        return job
    tier.copier.submit = damaging
    return damaged


def test_a_backup_copy_that_differs_from_its_device_pages_is_not_kept():
    """A backup whose host pages differ from the device pages it copied is a failed backup, found as
    it lands (`kv_store/tier_sums.py`): the node stays on device only (nothing of it reaches L3 or is
    loaded back later), counted; a later request still gets the cold engine's tokens."""
    from kv_store.copier import Direction

    engine = make_engine(page_size=4, num_pages=64, host_cache_pages=128)
    cold = make_engine(page_size=4, num_pages=64, enable_prefix_cache=False)
    damaged = _copies_damaged(engine, Direction.TO_HOST)
    [history] = make_prompts(1, min_len=40, max_len=40, seed=5)
    [first] = engine.generate([history], greedy(max_tokens=8))
    settle(engine)
    assert damaged and engine.host_cache.counters.l2_corrupt == len(damaged)
    assert all(n.residency is Residency.DEVICE and not n.host_pages for n in nodes(engine))
    assert not engine.host_cache.sums.kept
    turn2 = history + first.output_token_ids + [7, 8, 9]
    [got] = engine.generate([turn2], greedy(max_tokens=8))
    [expect] = cold.generate([turn2], greedy(max_tokens=8))
    assert got.output_token_ids == expect.output_token_ids
    engine.check_integrity()


def test_a_load_back_that_lands_different_bytes_fails_and_its_tokens_are_computed():
    """Host pages loaded back into device pages that then differ from them (the copy, not the host
    copy, went wrong): the load fails as it lands, counted; its device pages are freed, its nodes are
    not loaded again (they leave the tree), and the request computes those tokens: the cold engine's."""
    from kv_store.copier import Direction

    engine = make_engine(page_size=4, num_pages=64, host_cache_pages=128)
    cold = make_engine(page_size=4, num_pages=64, enable_prefix_cache=False)
    [history] = make_prompts(1, min_len=40, max_len=40, seed=6)
    [first] = engine.generate([history], greedy(max_tokens=8))
    settle(engine)
    engine.kvm.prefix_cache.evict(1000)
    assert all(n.residency is Residency.HOST for n in nodes(engine))
    damaged = _copies_damaged(engine, Direction.TO_DEVICE)
    turn2 = history + first.output_token_ids + [7, 8, 9]
    req = engine.add_request(turn2, greedy(max_tokens=8))
    settle(engine)
    [expect] = cold.generate([turn2], greedy(max_tokens=8))
    assert damaged and req.output_token_ids == expect.output_token_ids
    assert engine.host_cache.counters.l2_corrupt == len(damaged) == 1, "a failed load is not tried again"
    assert engine.host_cache.counters.copy_errors == 0 and not engine.host_cache.failed_loads
    engine.check_integrity()
