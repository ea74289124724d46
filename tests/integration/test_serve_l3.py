"""L3 through the product: `tandem serve` (defaults but for the L3 URL, KV checked after every
scheduler step) over a real `redis-server` on loopback. A ~1k-token prompt served once is in Redis;
after a restart, the same prompt's prefix comes back from L3 (usage and the tier metric say so) and
the answer is still HF transformers' greedy one. With Redis killed, requests are still answered."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.helpers import CHAT_PROMPTS, hf_greedy, smollm2
from tests.integration.serve_harness import metric, start_server
from tests.redis_server import RedisServer

pytestmark = pytest.mark.slow

PROMPT_TOKENS = 1000
MAX_NEW = 12
PAGE = 16


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def start(tmp_path_factory, redis_server):
    """start() starts `tandem serve` with L3 on the module's Redis; start.running() is the last one
    started while it still runs, else a new one. Every server started is stopped after."""
    started = []

    class Start:
        def __call__(self):
            server = start_server(tmp_path_factory.mktemp("serve-l3"),
                                  ["--set", "kv_store.l3.backend=redis", "--set", f"kv_store.l3.url={redis_server.url}"],
                                  env={"TANDEM_DEBUG_KV": "1"})
            started.append(server)
            return server

        def running(self):
            return started[-1] if started and started[-1].proc.poll() is None else self()

    yield Start()
    for server in started:
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


def eventually(check, what: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.5)


def wait_for_pages_in_redis(redis_server, num_pages: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while redis_server.client().dbsize() < num_pages:
        assert time.monotonic() < deadline, f"only {redis_server.client().dbsize()} pages in Redis"
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

    second = start()
    warm = complete(second, prompt)
    assert text(warm) == expected
    assert cached(warm) >= 0.9 * PROMPT_TOKENS, f"{cached(warm)} of {PROMPT_TOKENS} prompt tokens cached"
    # a fresh server: every L3 hit it counted is this request's (the figures come with heartbeats)
    eventually(lambda: metric(second.metrics(), "tandem:prefix_cache_hit_tokens_total", tier="l3") == cached(warm),
               "the L3 hit tokens counted equal the cached tokens of the usage")
    assert metric(second.metrics(), "tandem:l3_prefetches_total", outcome="completed") == 1


def test_with_redis_killed_requests_are_still_answered(start, redis_server):
    server = start.running()  # the restart test's second server, or a new one when run alone
    prompt, other = natural_prompt(300, "killed"), natural_prompt(200, "other")
    redis_server.kill()
    for p in (prompt, prompt, other):
        assert text(complete(server, p)) == hf_text(p)
    eventually(lambda: metric(server.metrics(), "tandem:l3_errors_total") >= 1, "an L3 error counted")
