"""L3 under the host tier, against a real redis-server: what one engine wrote another (a second
prefill worker, or the same worker after a restart) reuses; every fault is a counted miss and the
output never changes. Reference: a tiny engine with no cache at all."""

from __future__ import annotations

import dataclasses
import time

import pytest

from kv_store.l3.config import L3Config, PrefetchPolicy
from kv_store.residency import Residency
from tests.helpers import greedy, make_engine, make_prompts
from tests.redis_server import RedisServer

PAGE = 4


@pytest.fixture
def l3(redis_server):
    redis_server.client().flushall()
    return L3Config(url=redis_server.url, prefetch_policy="wait_complete", prefetch_min_pages=2, error_backoff_s=0.0)


def engine_with(l3: L3Config, **kw):
    return make_engine(page_size=PAGE, num_pages=128, host_cache_pages=128, l3=l3, **kw)


def settle(engine) -> None:
    while engine.busy():
        engine.step()
    assert engine.host_cache.l3.flush(10.0), "L3 writes did not drain"


@pytest.fixture(scope="module")
def shared_and_reference():
    [shared] = make_prompts(1, min_len=120, max_len=120, seed=11)
    reference = make_engine(page_size=PAGE, num_pages=256, enable_prefix_cache=False)
    prompt = shared + [5, 6, 7]
    [expect] = reference.generate([prompt], greedy(max_tokens=8))
    reference.check_integrity()
    return shared, prompt, expect.output_token_ids


def test_a_prefix_written_by_one_engine_is_served_from_l3_on_another(l3, shared_and_reference):
    shared, prompt, expect = shared_and_reference
    first = engine_with(l3)
    first.generate([shared], greedy(max_tokens=1))
    settle(first)
    assert first.tier_stats().l3_put_pages >= len(shared) // PAGE
    first.close()
    second = engine_with(l3)  # a fresh worker: L1 and L2 empty
    [req] = second.generate([prompt], greedy(max_tokens=8))
    assert req.output_token_ids == expect
    stats = second.tier_stats()
    assert req.cached_tokens == len(shared) // PAGE * PAGE and stats.hit_tokens_l3 == req.cached_tokens
    assert req.cached_tiers == (0, 0, req.cached_tokens)
    assert stats.l3_get_pages == len(shared) // PAGE and dict(stats.prefetches) == {"completed": 1}
    settle(second)
    second.check_integrity()
    second.close()


def test_corrupt_and_missing_values_are_counted_misses_never_used(l3, redis_server, shared_and_reference):
    shared, prompt, expect = shared_and_reference
    first = engine_with(l3)
    first.generate([shared], greedy(max_tokens=1))
    settle(first)
    keys = first.host_cache.l3.node_keys(next(iter(first.kvm.prefix_cache.root.children.values())))
    first.close()
    client = redis_server.client()
    prefix = l3.key_prefix
    value = client.get(prefix + keys[10])
    client.set(prefix + keys[10], value[:-1] + bytes([value[-1] ^ 0xFF]))  # one flipped byte: checksum fails
    second = engine_with(l3)
    [req] = second.generate([prompt], greedy(max_tokens=8))
    assert req.output_token_ids == expect
    stats = second.tier_stats()
    assert stats.l3_corrupt == 1 and stats.hit_tokens_l3 == 10 * PAGE, "pages past the corrupt one were used"
    assert client.get(prefix + keys[10]) is None, "the corrupt value was not deleted"
    settle(second)
    second.check_integrity()
    second.close()


def test_redis_down_is_a_miss_and_serving_goes_on(l3, tmp_path, shared_and_reference):
    shared, prompt, expect = shared_and_reference
    dead = RedisServer(tmp_path).start()
    url = dead.url
    dead.kill()
    engine = engine_with(dataclasses.replace(l3, url=url, op_timeout_s=0.2))
    [req] = engine.generate([prompt], greedy(max_tokens=8))
    settle(engine)
    assert req.output_token_ids == expect and req.cached_tokens == 0
    stats = engine.tier_stats()
    assert stats.l3_errors >= 1 and dict(stats.prefetches) == {"failed": 1}
    assert all(n.residency is Residency.BOTH for n in engine.kvm.prefix_cache.nodes())
    engine.check_integrity()
    engine.close()


def test_the_timeout_policy_waits_longer_for_a_longer_prefix(l3):
    """The default policy: a request waits prefetch_timeout_s plus prefetch_timeout_per_page_s per
    page it asked L3 for, so a long prefix is not given up in the time a short one takes."""
    assert L3Config(url=l3.url).policy is PrefetchPolicy.TIMEOUT
    config = dataclasses.replace(l3, prefetch_policy="timeout", prefetch_timeout_s=1.0,
                                 prefetch_timeout_per_page_s=0.01)
    engine = engine_with(config)
    tier = engine.host_cache.l3.l3
    waits = []
    for num_pages in (4, 200):
        before = time.monotonic()
        prefetch = tier.start_prefetch(list(range(num_pages * PAGE)), 0, [f"k{i}" for i in range(num_pages)])
        waits.append(prefetch.deadline - before)
        prefetch.wait(5)
    assert waits[0] == pytest.approx(1.04, abs=0.05) and waits[1] == pytest.approx(3.0, abs=0.05)
    engine.check_integrity()
