"""`tandem serve` exactly as a new user starts it (no flags but a free port), over HTTP: ordinary
concurrent load is queued, not refused; short prompts (and a next turn) prefill on the decode worker,
long new ones cross; overload gets answers and fast 429s, nothing else; a request
that leaves sampling unset gets the model's recommended sampling, and one that sets it wins."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import time

import httpx
import pytest

from tests.integration.serve_harness import eventually, metric, start_server

pytestmark = pytest.mark.slow

TTFT_BUDGET_S = 30.0  # router.max_queue_delay_s's default
FAST_S = 2.0  # a refusal comes at once


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("serve-product"), [])
    try:
        yield server
    finally:
        assert server.terminate() == 0, server.log_tail()


def random_prompt(rng: random.Random, num_tokens: int) -> list[int]:
    return [rng.randrange(100, 20000) for _ in range(num_tokens)]


async def stream_one(client: httpx.AsyncClient, body: dict) -> dict:
    """One streamed completion: status, seconds to the response (429) or to the first text, the
    Retry-After header, the completion tokens of its usage."""
    sent_s = time.monotonic()
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                              "stream_options": {"include_usage": True}}) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return {"status": resp.status_code, "answer_s": time.monotonic() - sent_s,
                    "retry_after": resp.headers.get("retry-after"), "body": resp.text}
        first_s, usage = None, None
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            frame = json.loads(line[6:])
            assert "error" not in frame, frame
            if frame.get("usage"):
                usage = frame["usage"]
            if first_s is None and any(c.get("text") for c in frame.get("choices", ())):
                first_s = time.monotonic() - sent_s
        return {"status": 200, "answer_s": first_s, "completion_tokens": usage and usage["completion_tokens"]}


def assert_greedy_is_hf(server, ids: list[int], max_tokens: int) -> None:
    """One greedy completion of `ids` over HTTP: its text is HF transformers' greedy one."""
    from tests.helpers import hf_greedy, smollm2

    loaded, reference = smollm2()
    resp = httpx.post(f"{server.base_url}/v1/completions", timeout=120, json={
        "model": "smollm2", "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == loaded.tokenizer.decode(hf_greedy(reference, ids, max_tokens))


def run_concurrently(server, bodies: list[dict]) -> list[dict]:
    async def run() -> list[dict]:
        limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=len(bodies))
        async with httpx.AsyncClient(base_url=server.base_url, limits=limits, timeout=300) as client:
            return await asyncio.gather(*(stream_one(client, body) for body in bodies))
    return asyncio.run(run())


def test_models_and_the_start_up_log_say_which_sampling_fills_unset_fields(server):
    [card] = httpx.get(f"{server.base_url}/v1/models", timeout=30).json()["data"]
    assert card["generation_defaults"] == {"temperature": 0.2, "top_p": 0.9, "top_k": 0,
                                           "source": "the SmolLM2-135M-Instruct model card"}
    assert "unset sampling fields: temperature=0.2 top_p=0.9 top_k=off (from the SmolLM2-135M-Instruct model card" \
        in server.log_tail(200_000)


def test_the_gateway_process_holds_no_torch(server):
    """The gateway tokenizes without transformers (which would load torch: ~300 MB of a RAM budget)."""
    httpx.post(f"{server.base_url}/v1/chat/completions", timeout=120, json={
        "model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}).raise_for_status()
    maps = open(f"/proc/{server.proc.pid}/maps").read()
    assert "libtorch" not in maps, "the gateway process loaded torch"


def test_workers_run_at_the_gateway_s_priority(server):
    """Ray starts its workers at nice 15 unless told otherwise: below the gateway and any client on the
    machine, which then take the workers' cores whenever they run."""
    gateway = os.getpriority(os.PRIO_PROCESS, server.proc.pid)
    workers = {w["worker_id"]: os.getpriority(os.PRIO_PROCESS, w["pid"]) for w in server.workers()}
    assert len(workers) == 2 and set(workers.values()) == {gateway}, (gateway, workers)


def test_a_lone_stream_decodes_in_c_on_the_idle_prefill_worker_s_core_too_and_matches_hf(server):
    """The default decode worker runs its single-request steps' layers in C (nothing compiles:
    `tandem:graph_compiling` is 0) and, while the prefill worker has nothing to compute, steps on its
    core too (2 threads, never more), and sends its tokens over the token relay, not Ray calls: its
    greedy text is still HF transformers' on the same prompt ids."""
    from tests.helpers import smollm2

    ids = smollm2()[0].tokenizer.encode("The three primary colors are", add_special_tokens=False)
    before = server.metrics()
    assert [v for (n, lbls), v in before.items() if n == "tandem:graph_compiling" and ("role", "decode") in lbls] == [0]
    assert_greedy_is_hf(server, ids, 48)
    replays = lambda m: metric(m, "tandem:graph_replays_total", role="decode") - metric(  # noqa: E731
        before, "tandem:graph_replays_total", role="decode")
    eventually(lambda: replays(server.metrics()) >= 40, "40 replayed steps in a heartbeat")  # single-request steps
    after = server.metrics()

    def moved(name: str, **labels) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    log_text = server.log_tail(200_000)
    assert re.search(r"decode steps: c_layers \([^)]*float32\)", log_text), "the C layers do not serve"
    assert "compiling the CPU decode step" not in log_text
    assert moved("tandem:worker_steps_total", role="decode", threads="2") >= 40, after
    # every token came over the decode worker's relay connection, none through a Ray collect call
    assert moved("tandem:worker_polls_total", role="decode", via="relay") >= 40
    assert moved("tandem:worker_polls_total", role="decode", via="collect") == 0
    assert not [k for k in after if k[0] == "tandem:worker_steps_total" and int(dict(k[1])["threads"]) > 2]


def test_a_short_prompt_prefills_on_the_decode_worker_and_a_long_one_crosses_from_the_prefill_worker(server):
    """Conditional disaggregation by default on a CPU: a prompt of which at most 256 tokens are not on
    the decode worker yet is prefilled there (no KV crosses): a short one, and a long one that
    continues it (a conversation's next turn); a long new one is prefilled by the prefill worker (its
    KV crosses). Every answer is HF transformers' greedy one on the same ids."""
    from tests.helpers import CHAT_PROMPTS, smollm2

    text = " ".join(CHAT_PROMPTS * 8)
    for salt, num_tokens, crosses in (("", 200, False), ("Another topic.", 400, True), ("", 420, False)):
        ids = smollm2()[0].tokenizer.encode(f"{salt} {text}" if salt else text, add_special_tokens=False)[:num_tokens]
        assert len(ids) == num_tokens
        before = server.metrics()
        assert_greedy_is_hf(server, ids, 8)
        after = server.metrics()
        moved = metric(after, "tandem:kv_transfer_bytes_total") - metric(before, "tandem:kv_transfer_bytes_total")
        routes = {dict(k[1])["prefill_worker"]: after[k] - before.get(k, 0) for k in after
                  if k[0] == "tandem:requests_routed_total" and after[k] != before.get(k, 0)}
        assert (moved > 0) is crosses, (num_tokens, moved, routes)
        assert len(routes) == 1 and (next(iter(routes)).startswith("prefill")) is crosses, (num_tokens, routes)


def test_the_served_context_is_the_models_and_a_prompt_longer_than_the_landing_prefills_where_it_decodes(server):
    """The context is SmolLM2's 8,192 tokens, not the decode worker's landing (2,048 tokens by
    default): a new 2,300-token prompt, too long to land, is prefilled on the decode worker (no KV
    crosses), and its greedy text is HF transformers' on the same ids."""
    from tests.helpers import CHAT_PROMPTS, smollm2

    [card] = httpx.get(f"{server.base_url}/v1/models", timeout=30).json()["data"]
    assert card["max_model_len"] == 8192
    landing_tokens = [w["stats"]["landing"]["total"] * w["stats"]["tiers"]["page_size"] for w in server.workers()
                      if w["role"] == "decode"]
    assert landing_tokens and max(landing_tokens) < 2300, landing_tokens
    text = " ".join(CHAT_PROMPTS * 40)
    ids = smollm2()[0].tokenizer.encode(f"A long one. {text}", add_special_tokens=False)[:2300]
    assert len(ids) == 2300
    before = server.metrics()
    assert_greedy_is_hf(server, ids, 4)
    after = server.metrics()
    assert metric(after, "tandem:kv_transfer_bytes_total") == metric(before, "tandem:kv_transfer_bytes_total")


def test_a_request_without_sampling_fields_gets_the_generation_config_and_a_request_with_them_wins(server):
    """What the engines were asked for (the sampling parameters of each started request, counted by
    the gateway when it hands them to the dispatcher): 0.2 / 0.9 for a request that sets nothing,
    exactly its own values for one that sets them."""
    def asked(body: dict) -> tuple[float, float]:
        before = server.metrics()
        resp = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=120, json={
            "model": "smollm2", "messages": [{"role": "user", "content": "What is a KV cache?"}], "max_tokens": 4,
            **body})
        assert resp.status_code == 200, resp.text
        after = server.metrics()
        moved = {f"{name}_{part}": metric(after, f"tandem:request_params_{name}_{part}")
                 - metric(before, f"tandem:request_params_{name}_{part}")
                 for name in ("temperature", "top_p") for part in ("count", "sum")}
        assert moved["temperature_count"] == moved["top_p_count"] == 1, moved
        return round(moved["temperature_sum"], 6), round(moved["top_p_sum"], 6)

    assert asked({}) == (0.2, 0.9)
    assert asked({"temperature": 0, "top_p": 1.0}) == (0.0, 1.0)
    assert asked({"temperature": 0.7}) == (0.7, 0.9)  # top_p unset: still the model's


def test_a_burst_of_32_concurrent_128_token_requests_is_queued_not_refused(server):
    rng = random.Random(27)
    refused_before = metric(server.metrics(), "tandem:requests_refused_total")
    bodies = [{"model": "smollm2", "prompt": random_prompt(rng, 128), "max_tokens": 32, "temperature": 0,
               "ignore_eos": True} for _ in range(32)]
    results = run_concurrently(server, bodies)
    assert [r["status"] for r in results] == [200] * 32, [r for r in results if r["status"] != 200][:3]
    assert all(r["completion_tokens"] == 32 for r in results)
    assert max(r["answer_s"] for r in results) <= TTFT_BUDGET_S + FAST_S
    assert metric(server.metrics(), "tandem:requests_refused_total") == refused_before


def test_overload_gets_only_answers_and_fast_429s(server):
    """96 requests at once, more than the decode worker's 64 slots (its batch: no admitted request
    waits for one): the rest are refused at once with Retry-After; every admitted one is served in
    full, its first token within the TTFT budget; nothing else happens."""
    rng = random.Random(28)
    bodies = [{"model": "smollm2", "prompt": random_prompt(rng, 16), "max_tokens": 24, "temperature": 0,
               "ignore_eos": True} for _ in range(96)]
    results = run_concurrently(server, bodies)
    served = [r for r in results if r["status"] == 200]
    refused = [r for r in results if r["status"] == 429]
    assert len(served) + len(refused) == len(results), [r for r in results if r["status"] not in (200, 429)][:3]
    assert refused, "nothing was refused: 96 requests fit 64 decode slots?"
    assert len(served) >= 64
    assert all(r["retry_after"] and float(r["retry_after"]) >= 1 for r in refused)
    assert max(r["answer_s"] for r in refused) <= FAST_S
    assert all(r["completion_tokens"] == 24 for r in served)
    assert max(r["answer_s"] for r in served) <= TTFT_BUDGET_S + FAST_S
