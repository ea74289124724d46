"""L3 through the product: `tandem serve` (defaults but for the L3 URL, KV checked after every
scheduler step) over a real `redis-server` on loopback. A 480-token prompt served once is in Redis;
after a restart, the same prompt's prefix comes back from L3 (usage and the tier metric say so) and
the answer is still HF transformers' greedy one. With two prefill workers taking turns, a long
shared prefix is prefilled once: the other worker fetches it from L3. With Redis killed, requests
are still answered."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.helpers import CHAT_PROMPTS, hf_greedy, smollm2
from tests.integration.serve_harness import eventually, metric, start_server

pytestmark = pytest.mark.slow

PROMPT_TOKENS = 480
MAX_NEW = 12
PAGE = 16
# two prefill workers taking turns, every prompt crossing to one (a question alone would stay on the
# decode worker where the prefix is)
TWO_PREFILL = ("--num-prefill", "2", "--policy", "round_robin", "--set", "router.local_prefill_max_tokens=0")


@pytest.fixture(scope="module")
def start(tmp_path_factory, redis_server):
    """start(args) stops the server running (one at a time: they share the machine) and starts
    `tandem serve` with L3 on the module's Redis; start.running(args) is the one running if it was
    started with `args` (any, without), or a new one (each start costs ~30 s of the suite)."""
    started: list[tuple[tuple, object]] = []

    class Start:
        def __call__(self, args=()):
            for _, server in started:
                if server.proc.poll() is None:
                    assert server.terminate() == 0, server.log_tail()
            server = start_server(tmp_path_factory.mktemp("serve-l3"),
                                  ["--set", "kv_store.l3.backend=redis", "--set", f"kv_store.l3.url={redis_server.url}",
                                   *args], env={"TANDEM_DEBUG_KV": "1"}, warm=False)
            started.append((tuple(args), server))
            return server

        def running(self, args=None):
            if started and started[-1][1].proc.poll() is None and args in (None, started[-1][0]):
                return started[-1][1]
            return self(args or ())

    yield Start()
    for _, server in started:
        if server.proc.poll() is None:
            assert server.terminate() == 0, server.log_tail()


def natural_prompt(num_tokens: int, salt: str) -> list[int]:
    """`num_tokens` ids of English text (no near-ties in greedy, unlike random ids)."""
    loaded, _ = smollm2()
    text = salt + " " + " ".join(CHAT_PROMPTS * 8)
    ids = loaded.tokenizer.encode(text, add_special_tokens=False)[:num_tokens]
    assert len(ids) == num_tokens
    return ids


def complete(server, prompt: list[int]) -> dict:
    resp = httpx.post(f"{server.base_url}/v1/completions", timeout=300, json={
        "model": "smollm2", "prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    return resp.json()


def cached(body: dict) -> int:
    return (body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def text(body: dict) -> str:
    assert body["usage"]["completion_tokens"] == MAX_NEW
    return body["choices"][0]["text"]


def hf_text(prompt: list[int]) -> str:
    """HF transformers' greedy continuation of `prompt`, as text (the independent reference)."""
    loaded, reference = smollm2()
    return loaded.tokenizer.decode(hf_greedy(reference, prompt, MAX_NEW), skip_special_tokens=True)


def wait_for_pages_in_redis(redis_server, num_pages: int, timeout_s: float = 60) -> None:
    client = redis_server.client()
    deadline = time.monotonic() + timeout_s
    while client.dbsize() < num_pages:
        assert time.monotonic() < deadline, f"only {client.dbsize()} pages in Redis"
        time.sleep(0.5)


def test_after_a_restart_the_prompt_is_served_from_l3_with_hf_greedy_output(start, redis_server):
    prompt = natural_prompt(PROMPT_TOKENS, "restart")
    expected = hf_text(prompt)

    first = start()
    cold = complete(first, prompt)
    assert cached(cold) == 0 and text(cold) == expected
    whole_pages = PROMPT_TOKENS // PAGE
    wait_for_pages_in_redis(redis_server, whole_pages - 1)  # the last page may hold the prompt's end only
    assert first.terminate() == 0, first.log_tail()

    second = start(TWO_PREFILL)  # another shape (two prefill workers) finds it too; the next test's server
    warm = complete(second, prompt)
    assert text(warm) == expected
    assert cached(warm) >= 0.9 * PROMPT_TOKENS, f"{cached(warm)} of {PROMPT_TOKENS} prompt tokens cached"
    # a fresh server: every L3 hit it counted is this request's (the figures come with heartbeats)
    eventually(lambda: metric(second.metrics(), "tandem:prefix_cache_hit_tokens_total", tier="l3") == cached(warm),
               "the L3 hit tokens counted equal the cached tokens of the usage")
    assert metric(second.metrics(), "tandem:l3_prefetches_total", outcome="completed") == 1


def test_two_prefill_workers_prefill_a_shared_prefix_once_and_share_it_through_l3(start, redis_server):
    """6 requests with one ~450-token prefix and different questions, sent in turn to two prefill
    workers (round robin: 3 each): the prefix is prefilled once in all, the second worker's first
    request fetches it from L3, and the answers are HF's greedy ones."""
    server = start.running(TWO_PREFILL)
    redis_server.client().flushall()  # only this test's pages from here on
    prefix = natural_prompt(PROMPT_TOKENS - 24, "shared")
    loaded, _ = smollm2()
    suffixes = [loaded.tokenizer.encode(f" Question {i}: what is {i} times {i + 3}?", add_special_tokens=False)
                for i in range(6)]
    prompts = [prefix + suffix for suffix in suffixes]
    before = server.metrics()
    bodies = [complete(server, prompts[0])]
    wait_for_pages_in_redis(redis_server, len(prefix) // PAGE)  # A's prefix written before B asks
    bodies += [complete(server, prompt) for prompt in prompts[1:]]
    after = server.metrics()
    assert [text(b) for b in bodies[:3]] == [hf_text(p) for p in prompts[:3]]
    whole_prefix = len(prefix) // PAGE * PAGE
    assert cached(bodies[1]) >= whole_prefix, f"the second worker's first request cached {cached(bodies[1])}"
    prefilled = sum(b["usage"]["prompt_tokens"] - cached(b) for b in bodies)
    least = len(prefix) + sum(len(s) for s in suffixes)
    assert prefilled <= 1.2 * least, f"{prefilled} tokens prefilled; the prefix once and the questions: {least}"
    l3_hits = {w: metric(after, "tandem:prefix_cache_hit_tokens_total", tier="l3", worker=w) -
               metric(before, "tandem:prefix_cache_hit_tokens_total", tier="l3", worker=w)
               for w in ("prefill-0", "prefill-1")}
    # the worker A went to had the prefix on device; the other (round robin: B's) fetched it once
    assert sorted(l3_hits.values()) == [0, whole_prefix], l3_hits


def test_with_redis_killed_requests_are_still_answered(start, redis_server):
    server = start.running()  # the server of the test before, or a new one when run alone
    prompt, other = natural_prompt(300, "killed"), natural_prompt(200, "other")
    redis_server.kill()
    for p in (prompt, prompt, other):
        assert text(complete(server, p)) == hf_text(p)
    eventually(lambda: metric(server.metrics(), "tandem:l3_errors_total") >= 1, "an L3 error counted")
