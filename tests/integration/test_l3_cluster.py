"""L3 (Redis) under the real relay: two prefill workers and one decode worker (`WorkerHost` threads
with the tiny Llama and `LocalTransport`s) behind a round-robin `Dispatcher`, every worker's host
tier over one real `redis-server`. What one prefill worker wrote another serves from L3; a Redis
that dies mid-run, or a corrupt value, costs misses and never a request or a wrong token.
Reference: a tiny engine with no cache at all (same page size and chunking).

One server and one set of workers serve the module (each test builds its own dispatcher, so round
robin starts at prefill-0 again); the Redis-killed test has its own server and workers. Prompts of
different tests never share a prefix, so their tier figures are compared as before/after deltas.
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from cluster.worker_host.thread import WorkerHost
from common.config import EngineConfig
from common.protocol import TierStats
from kv_store.l3.config import L3Config
from router.dispatcher import Dispatcher
from router.policy import Policy
from tests import dispatch_harness
from tests.dispatch_harness import (
    MAX_MODEL_LEN,
    REST_TIMEOUT_S,
    all_at_rest,
    queue_all,
    start_hosts,
    stop_hosts,
    wait_for,
)
from tests.helpers import greedy, make_engine, make_prompts
from tests.redis_server import RedisServer

PAGE = 16
CHUNK = 64
MAX_NEW = 8
ENGINE = EngineConfig(page_size=PAGE, num_pages=1 + 4096 // PAGE, chunk_size=CHUNK, debug_kv=True)
LANDING_PAGES = 1 + 4096 // PAGE  # decode-0's host pages for landings (+1: the scratch page)
WORKERS = (("prefill-0", "prefill", 0), ("prefill-1", "prefill", 0), ("decode-0", "decode", LANDING_PAGES))


# ---- workers and the dispatcher over them ------------------------------------------------------------


def serve(hosts: dict[str, WorkerHost], scenario, **kw):
    """`await scenario(d)` under a fresh round-robin dispatcher, on a fresh loop."""
    return dispatch_harness.serve(hosts, lambda d, _views: scenario(d), policy=Policy.ROUND_ROBIN, **kw)


async def run(d: Dispatcher, rid: str, prompt: list[int]):
    """(token ids, last chunk) of one greedy request."""
    chunks = [c async for c in d.generate(rid, prompt, greedy(max_tokens=MAX_NEW))]
    assert all(c.finish_reason is None for c in chunks[:-1]), f"{rid}: a chunk before the last one ended it"
    return [t for c in chunks for t in c.new_token_ids], chunks[-1]


async def settle(d: Dispatcher, hosts: dict[str, WorkerHost]) -> dict[str, TierStats]:
    """Every worker at rest (nothing owned, no locked tree node, integrity OK), every L3 write sent;
    returns each worker's tier figures as the dispatcher's gauges show them after that."""
    await all_at_rest(hosts)
    for host in hosts.values():  # idle: every backup finished, so every L3 put is queued
        assert host.worker.engine.host_cache.l3.flush(REST_TIMEOUT_S), f"{host.worker_id}: L3 writes did not drain"
        assert not host.crashed, host.crashed
        host.worker.check_integrity()
        cache = host.worker.engine.kvm.prefix_cache
        assert cache.evictable_pages() == cache.cached_pages(), f"{host.worker_id}: a tree node is still locked"
    asked = time.time()

    def gauges():
        return {g.worker_id: g for g in d.worker_gauges()}

    def current() -> bool:  # a heartbeat from after the drain, relayed to the dispatcher
        return all(h.conn.stats_unix_s > asked and gauges()[wid].tiers == h.conn.stats.tiers
                   for wid, h in hosts.items())

    await wait_for(current, "heartbeats from after the drain to reach the dispatcher")
    return {wid: g.tiers for wid, g in gauges().items()}


def delta(after: TierStats, before: TierStats, name: str) -> int:
    return getattr(after, name) - getattr(before, name)


def prefetches(tiers: TierStats) -> dict[str, int]:
    return dict(tiers.prefetches)


def l3_keys(hosts, token_ids: list[int]) -> list[str]:
    """Redis keys of the whole pages of `token_ids` (the workers' own key chain; pure)."""
    tier = hosts["prefill-0"].worker.engine.host_cache.l3.l3
    return [tier.config.key_prefix + k for k in tier.keys(token_ids)]


# ---- fixtures -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield srv
    srv.stop()


def l3_config(url: str, **kw) -> L3Config:
    return L3Config(url=url, prefetch_policy="wait_complete", prefetch_min_pages=2, **kw)


@pytest.fixture(scope="module")
def hosts(server):
    server.client().flushall()
    built = start_hosts(ENGINE, WORKERS, l3=l3_config(server.url, error_backoff_s=0.0))
    yield built
    stop_hosts(built)


@pytest.fixture(scope="module")
def reference():
    """Greedy token ids of an engine without any cache, memoised per prompt."""
    engine = make_engine(page_size=PAGE, num_pages=ENGINE.num_pages, chunk_size=CHUNK,
                         enable_prefix_cache=False, host_cache_pages=0)
    done: dict[tuple, list[int]] = {}

    def run_all(prompts: list[list[int]]) -> list[list[int]]:
        todo = list({tuple(pr): pr for pr in prompts if tuple(pr) not in done}.values())
        for pr, req in zip(todo, engine.generate(todo, greedy(max_tokens=MAX_NEW))):
            done[tuple(pr)] = list(req.output_token_ids)
        engine.check_integrity()
        return [done[tuple(pr)] for pr in prompts]

    return run_all


def distinct_suffixes(n: int, length: int, seed: int) -> list[list[int]]:
    """`n` suffixes whose first tokens all differ (so no two prompts share the page they start)."""
    rng = random.Random(seed)
    firsts = rng.sample(range(3, 256), n)
    return [[first] + [rng.randrange(3, 256) for _ in range(length - 1)] for first in firsts]


# ---- tests ----------------------------------------------------------------------------------------------


def test_prefix_written_by_one_prefill_worker_is_served_to_the_other_from_l3(hosts, server, reference):
    [shared] = make_prompts(1, min_len=970, max_len=970, seed=31)
    suffix_a, suffix_b = distinct_suffixes(2, 14, seed=32)
    prompt_a, prompt_b = shared + suffix_a, shared + suffix_b
    assert len(prompt_b) + MAX_NEW <= MAX_MODEL_LEN
    shared_pages = len(shared) // PAGE  # 60: page 60 holds the end of `shared` and the suffix's start
    expected = reference([prompt_a, prompt_b])
    keys = l3_keys(hosts, shared)
    assert len(keys) == shared_pages

    async def scenario(d):
        before = await settle(d, hosts)
        a = await run(d, "l3-a", prompt_a)
        assert d.state.shared_match_len(prompt_b) == len(shared), "the router did not note A's prefill"
        after_a = await settle(d, hosts)
        assert server.client().exists(*keys) == shared_pages, "the shared prefix is not all in Redis"
        b = await run(d, "l3-b", prompt_b)
        return before, a, after_a, b, await settle(d, hosts)

    before, (tokens_a, last_a), after_a, (tokens_b, last_b), after_b = serve(hosts, scenario)
    assert (last_a.prefill_worker, last_b.prefill_worker) == ("prefill-0", "prefill-1"), "not round robin"
    assert (last_a.decode_worker, last_b.decode_worker) == ("decode-0", "decode-0")
    assert not last_a.error and not last_b.error
    assert [tokens_a, tokens_b] == expected
    assert all(after_b[w].l3 for w in hosts), "every worker reports it shares L3 (routing credits it)"
    assert last_a.cached_tokens == 0
    written = sum(delta(after_a[w], before[w], "l3_put_pages") for w in hosts)
    assert written >= shared_pages, f"{written} pages written to L3 for a {shared_pages}-page prefix"
    # B on prefill-1 (nothing of it in L1 or L2 there): the whole shared prefix came from L3.
    assert last_b.cached_tokens == shared_pages * PAGE
    p1, p1_before = after_b["prefill-1"], after_a["prefill-1"]
    assert delta(p1, p1_before, "hit_tokens_l3") == shared_pages * PAGE
    assert delta(p1, p1_before, "l3_get_pages") == shared_pages
    assert prefetches(p1).get("completed", 0) - prefetches(p1_before).get("completed", 0) == 1
    assert delta(p1, p1_before, "hit_tokens_l1") == 0
    assert all(delta(after_b[w], before[w], "l3_errors") == delta(after_b[w], before[w], "l3_corrupt") == 0
               for w in hosts)


def test_corrupt_page_in_redis_is_detected_and_the_output_is_the_references(hosts, server, reference):
    [shared] = make_prompts(1, min_len=40 * PAGE, max_len=40 * PAGE, seed=41)
    suffix_c, suffix_d = distinct_suffixes(2, 9, seed=42)
    prompt_c, prompt_d = shared + suffix_c, shared + suffix_d
    bad_page = 10
    expected = reference([prompt_c, prompt_d])
    keys = l3_keys(hosts, shared)
    client = server.client()

    async def scenario(d):
        c = await run(d, "l3-c", prompt_c)
        before = await settle(d, hosts)
        assert client.exists(*keys) == len(keys), "the prefix is not all in Redis"
        value = client.get(keys[bad_page])
        corrupt = value[:-1] + bytes([value[-1] ^ 0xFF])  # one flipped byte: the checksum fails
        client.set(keys[bad_page], corrupt)
        dd = await run(d, "l3-d", prompt_d)
        return c, before, corrupt, dd, await settle(d, hosts)

    (tokens_c, last_c), before, corrupt, (tokens_d, last_d), after = serve(hosts, scenario)
    assert (last_c.prefill_worker, last_d.prefill_worker) == ("prefill-0", "prefill-1"), "not round robin"
    assert not last_c.error and not last_d.error
    assert [tokens_c, tokens_d] == expected
    p1, p1_before = after["prefill-1"], before["prefill-1"]
    assert delta(p1, p1_before, "l3_corrupt") == 1
    assert last_d.cached_tokens == bad_page * PAGE, "pages at or past the corrupt one were used"
    assert delta(p1, p1_before, "hit_tokens_l3") == bad_page * PAGE
    assert prefetches(p1).get("partial", 0) - prefetches(p1_before).get("partial", 0) == 1
    # The corrupt value was deleted; D's own backup then wrote the page again, verified.
    value = client.get(keys[bad_page])
    assert value is not None and value != corrupt, "the corrupt value was not deleted (or not written again)"


def test_per_tier_hit_tokens_add_up_to_the_tokens_served(hosts, reference):
    [shared] = make_prompts(1, min_len=8 * PAGE, max_len=8 * PAGE, seed=61)
    suffix_e, suffix_f = distinct_suffixes(2, 5, seed=62)
    prompts = [shared + suffix_e, shared + suffix_f]
    expected = reference(prompts)

    async def scenario(d):
        e = await run(d, "l3-e", prompts[0])
        before = await settle(d, hosts)
        f = await run(d, "l3-f", prompts[1])
        return e, before, f, await settle(d, hosts)

    (tokens_e, last_e), before, (tokens_f, last_f), after = serve(hosts, scenario)
    assert (last_e.prefill_worker, last_f.prefill_worker) == ("prefill-0", "prefill-1")
    assert [tokens_e, tokens_f] == expected
    p1, p1_before = after["prefill-1"], before["prefill-1"]
    assert last_f.cached_tokens == 8 * PAGE == delta(p1, p1_before, "hit_tokens_l3")
    served = sum(delta(p1, p1_before, f"hit_tokens_l{tier}") for tier in (1, 2, 3))
    assert served == last_f.cached_tokens, (
        f"per-tier hit tokens sum to {served} for {last_f.cached_tokens} prompt tokens served from cache")


def test_redis_killed_mid_run_costs_misses_never_a_request(tmp_path, reference):
    """L3 works (prefill-1 fetches what prefill-0 wrote), then Redis stops answering with requests in
    flight and is killed while calls to it hang; then requests whose prefixes only L3 could have had
    arrive. Every request gets the reference's tokens; the faults are counted; nothing leaks."""
    server = RedisServer(tmp_path / "redis").start()
    hosts = start_hosts(ENGINE, WORKERS, l3=l3_config(server.url, op_timeout_s=0.2, error_backoff_s=0.1))
    prefixes = make_prompts(5, min_len=12 * PAGE, max_len=12 * PAGE, seed=51)
    sfx = distinct_suffixes(3, 7, seed=52)
    warm = [prefixes[0] + sfx[0]]  # -> prefill-0, which writes prefixes[0] to L3
    # -> prefill-1, -0, -1, ...: the first one fetches prefixes[0] from L3
    during = [prefixes[0] + sfx[1], prefixes[1] + sfx[0], prefixes[0] + sfx[2], prefixes[1] + sfx[1],
              prefixes[2] + sfx[0], prefixes[2] + sfx[1]]
    after = [prefixes[3] + sfx[0], prefixes[3] + sfx[1], prefixes[4] + sfx[0], prefixes[4] + sfx[1],
             prefixes[1] + sfx[2], prefixes[2] + sfx[2]]
    prompts = warm + during + after
    expected = reference(prompts)
    keys = l3_keys(hosts, prefixes[0])
    client = server.client()
    fetched = lambda: (st := hosts["prefill-1"].conn.stats) is not None and st.tiers.hit_tokens_l3 > 0  # noqa: E731

    try:
        async def scenario(d):
            tasks = [asyncio.create_task(run(d, "k0", warm[0]))]
            await wait_for(lambda: client.exists(*keys) == len(keys), "the warm prefix written to L3")
            tasks += [asyncio.create_task(run(d, f"k{i}", pr)) for i, pr in enumerate(during, start=1)]
            await wait_for(fetched, "prefill-1 to fetch the warm prefix from L3")
            in_flight_at_kill = len(d.flights)
            server.pause()  # calls to it hang (up to op_timeout_s) ...
            tasks += [asyncio.create_task(run(d, f"k{i}", pr)) for i, pr in enumerate(after, start=1 + len(during))]
            await asyncio.sleep(0.1)
            server.kill()  # ... and are cut off: the connections reset, new ones are refused
            results = await asyncio.gather(*tasks)
            return in_flight_at_kill, results, await settle(d, hosts)

        in_flight_at_kill, results, tiers = serve(hosts, scenario, admission=queue_all(len(prompts)))
    finally:
        stop_hosts(hosts)
        server.stop()
    assert in_flight_at_kill > 0, "every request had finished before Redis died"
    failed = [(last.finish_reason, last.error) for _, last in results
              if last.error or last.finish_reason not in ("stop", "length")]
    assert not failed, failed
    assert [tokens for tokens, _ in results] == expected
    assert tiers["prefill-1"].hit_tokens_l3 >= len(keys) * PAGE
    assert sum(t.l3_errors for t in tiers.values()) > 0, tiers
    # The prefixes of `after` were never written: with Redis dead their lookups failed (not "short").
    assert sum(prefetches(t).get("failed", 0) for t in tiers.values()) > 0, tiers
    assert all(t.l3_corrupt == 0 and t.copy_errors == 0 for t in tiers.values())
