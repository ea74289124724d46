"""`tandem serve` end to end: a Ray head started here, the server as a real process (controller,
2 prefill + 1 decode worker actors over Mooncake TCP, the gateway), the official `openai` client.
Worker-side checks read the workers' heartbeat stats through `/debug/workers`."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time

import httpx
import openai
import pytest

from cluster.cli.main import main as tandem_main
from common.config import SamplingParams
from engine.batch import run_batch
from router.gateway.siblings import sibling_seed
from tests.helpers import make_smollm2_engine
from tests.integration.lm_eval_check import check_lm_eval
from tests.integration.logit_rules_check import check_logit_rules
from tests.integration.logprobs_check import check_logprobs
from tests.integration.serve_harness import RayHead, eventually, metric, seeded_streams, start_server
from tests.integration.structured_check import check_structured
from tests.integration.tools_check import check_tools

pytestmark = pytest.mark.slow

API_KEY = "sk-tandem-test"
MAX_PROMPT_TOKENS = 1024
MAX_BODY_BYTES = 65536
CONFIG = f"""
model: smollm2
engine: {{num_pages: 512, chunk_size: 128, max_model_len: 2048}}
prefill: {{count: 2, num_cpus: 1}}
decode: {{count: 1, num_cpus: 1, host_pages: 512}}
# max_queued_requests: bursts here test function, not overload
router: {{policy: cache_aware, max_queue_delay_s: 600, max_queued_requests: 64,
         local_prefill_max_tokens: 0}}  # every prompt crosses: this module tests disaggregation
gateway: {{max_prompt_tokens: {MAX_PROMPT_TOKENS}, max_body_bytes: {MAX_BODY_BYTES}}}
cluster: {{heartbeat_timeout_s: 10.0, drain_timeout_s: 10.0}}
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The server joins a Ray head started here (`--address`), as on a real cluster."""
    tmp = tmp_path_factory.mktemp("serve")
    (tmp / "cluster.yaml").write_text(CONFIG)
    head = RayHead.start(num_cpus=4, workdir=tmp)
    server = None
    try:
        server = start_server(tmp, ["--config", str(tmp / "cluster.yaml"), "--address", head.address], api_key=API_KEY,
                              env={**head.env, "TANDEM_DEBUG_KV": "1"})  # reaches the workers through their config
        server.ray_address, server.ray_env = head.address, head.env
        yield server
    finally:
        if server is not None:
            code = server.terminate()
            assert code == 0, f"tandem serve exited with {code}:\n{server.log_tail()}"
        head.stop()


@pytest.fixture
def client(cluster):
    return openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def tandem_run(capsys, prompt: str, max_tokens: int, raw: bool) -> str:
    capsys.readouterr()
    assert tandem_main(["run", "--prompt", prompt, "--max-tokens", str(max_tokens), "--json",
                        *(["--raw"] if raw else [])]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["text"]


def workers(server) -> list[dict]:
    resp = httpx.get(f"{server.base_url}/debug/workers", headers=server.headers(), timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()["workers"]


def wait_workers_at_rest(server, timeout_s: float = 60.0, expect: int = 3) -> list[dict]:
    """Until all `expect` workers are alive and report (heartbeat stats) no request, no transfer,
    no PRIVATE or IN_FLIGHT page, and a passing integrity check on device and landing pool."""
    deadline, found = time.monotonic() + timeout_s, []
    while time.monotonic() < deadline:
        found = [w for w in workers(server) if w["alive"] and w["stats"] is not None]
        if len(found) == expect and all(_at_rest(w["stats"]) for w in found):
            return found
        time.sleep(0.5)
    raise AssertionError(f"workers not at rest after {timeout_s}s: {found}")


def _at_rest(stats: dict) -> bool:
    pools = [stats["device"]] + ([stats["landing"]] if stats["landing"] else [])
    return (not stats["integrity_error"] and stats["num_running"] == stats["num_waiting"] == 0
            and stats["num_transfers"] == 0 and all(pool["private"] == 0 and pool["in_flight"] == 0 for pool in pools))


QUESTION = "What is a KV cache? Answer in one sentence."
RAW_PROMPT = "The three primary colors are"


def test_openai_client_matches_tandem_run(client, capsys):
    chat_ref = tandem_run(capsys, QUESTION, 24, raw=False)
    raw_ref = tandem_run(capsys, RAW_PROMPT, 16, raw=True)

    chat = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": QUESTION}],
                                          max_tokens=24, temperature=0)
    assert chat.choices[0].message.content == chat_ref
    assert chat.usage.completion_tokens <= 24 and chat.usage.prompt_tokens > 0

    stream = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": QUESTION}],
                                            max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat_ref
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == chat.usage.completion_tokens

    comp = client.completions.create(model="smollm2", prompt=RAW_PROMPT, max_tokens=16, temperature=0)
    assert comp.choices[0].text == raw_ref
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="smollm2", prompt=RAW_PROMPT, max_tokens=16, temperature=0, stream=True) if c.choices)
    assert streamed == raw_ref
    assert [m.id for m in client.models.list().data] == ["smollm2"]


def test_penalties_biases_and_min_tokens_give_hfs_greedy_tokens_across_workers(client):
    """Every prompt here prefills on a prefill worker, which samples the first token under the rules
    (min_tokens, the bias), and the decode worker the rest."""
    check_logit_rules(client)


def test_logprobs_are_hfs_across_workers(client):
    """The prompt's and the first token's from a prefill worker, the rest from the decode worker."""
    check_logprobs(client)


def test_structured_outputs_hold_for_the_openai_sdk_and_langchain_across_workers(cluster):
    """The prefill worker samples the first token under the grammar; the decode worker resumes it."""
    check_structured(cluster.base_url, API_KEY)


def test_tool_calls_reassemble_for_the_openai_sdk_and_langchain_across_workers(cluster):
    check_tools(cluster.base_url, API_KEY)


def test_lm_eval_local_completions_scores_as_its_hf_backend(cluster):
    check_lm_eval(cluster.base_url, API_KEY)


def test_n_choices_cross_once_are_seeded_apart_and_repeat_alone_or_in_a_busy_batch(client, cluster):
    """n = 4 with a seed: four different samples, the same four again, and the same four while other
    streams keep the batch busy; choice 0's prompt crossed from a prefill worker, the three siblings
    prefilled on its decode worker from the prefix cache it filled (only the last partial page). On
    that other path, and in an engine alone, each choice is the same: choice i is the request seeded
    `sibling_seed(3, i)` (top_p is set: the served default is the model card's)."""
    prompt = "Tell me about the harbour town. " * 6 + "The first thing visitors notice is"
    sampling = dict(temperature=0.9, top_p=0.95, max_tokens=8)
    ask = dict(model="smollm2", prompt=prompt, n=4, seed=3, **sampling,
               extra_body={"ignore_eos": True, "return_token_ids": True})
    before = cluster.metrics()
    first = client.completions.create(**ask)
    after = cluster.metrics()
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert [c.index for c in first.choices] == [0, 1, 2, 3] and len(set(texts)) == 4, texts
    assert first.usage.completion_tokens == 32
    routed = lambda samples, **labels: metric(samples, "tandem:requests_routed_total", **labels)  # noqa: E731
    crossed = sum(routed(after, prefill_worker=w) - routed(before, prefill_worker=w)
                  for w in ("prefill-0", "prefill-1"))
    assert crossed == 1 and routed(after, prefill_worker="") - routed(before, prefill_worker="") == 3
    prompt_len = len(first.choices[0].prompt_token_ids)
    hits = metric(after, "tandem:prefix_cache_hits_total") - metric(before, "tandem:prefix_cache_hits_total")
    assert hits >= 3 * (prompt_len - 16), (hits, prompt_len)  # page_size 16: each sibling reused the whole pages
    ids = [c.token_ids for c in sorted(first.choices, key=lambda c: c.index)]
    alone = [client.completions.create(**{**ask, "n": 1, "seed": sibling_seed(3, i)}).choices[0].token_ids
             for i in (1, 2, 3)]  # each crossed from a prefill worker: its prompt computed there, not forked
    assert alone == ids[1:]
    engine = make_smollm2_engine(enable_prefix_cache=False)
    reqs = run_batch(engine, [first.choices[0].prompt_token_ids] * 4,
                     [SamplingParams(seed=sibling_seed(3, i), ignore_eos=True, **sampling) for i in range(4)])
    assert [r.output_token_ids for r in reqs] == ids
    engine.check_integrity()

    assert [c.text for c in sorted(client.completions.create(**ask).choices, key=lambda c: c.index)] == texts
    aclient = openai.AsyncOpenAI(base_url=f"{cluster.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=300)

    async def busy() -> list[str]:
        others = [aclient.completions.create(model="smollm2", prompt=f"Story {i}: once", max_tokens=24,
                                             temperature=0.7, extra_body={"ignore_eos": True}) for i in range(4)]
        *_, mine = await asyncio.gather(*others, aclient.completions.create(**ask))
        return [c.text for c in sorted(mine.choices, key=lambda c: c.index)]
    assert asyncio.run(busy()) == texts


def test_sixteen_concurrent_streams_and_metrics(cluster):
    server = cluster
    before = server.metrics()
    aclient = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=300)

    async def one(i: int) -> tuple[str, str]:
        stream = await aclient.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": f"Count from {i} to {i + 5}."}],
            max_tokens=12, temperature=0, stream=True)
        text, finish = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def all_of_them():
        try:
            return await asyncio.gather(*(one(i) for i in range(16)))
        finally:
            await aclient.close()

    results = asyncio.run(all_of_them())
    assert all(text and finish in ("stop", "length") for text, finish in results), results
    after = server.metrics()
    moved = lambda name: metric(after, name) - metric(before, name)  # noqa: E731
    assert moved("tandem:request_success_total") == 16
    assert moved("tandem:time_to_first_token_seconds_count") == 16
    assert moved("tandem:e2e_request_latency_seconds_count") == 16
    assert moved("tandem:generation_tokens_total") >= 16
    assert moved("tandem:kv_transfer_bytes_total") > 0
    wait_workers_at_rest(server)


def test_a_second_server_in_the_same_namespace_is_refused(cluster, tmp_path):
    import subprocess
    import sys

    from tests.integration.serve_harness import REPO, free_port

    second = subprocess.run([sys.executable, "-m", "cluster.cli", "serve", "--port", str(free_port()),
                             "--address", cluster.ray_address], cwd=REPO, capture_output=True, text=True,
                            timeout=300, env={**os.environ, **cluster.ray_env})
    assert second.returncode == 1, second.stderr[-3000:]
    assert "tandem: error: another tandem serve is running in Ray namespace 'tandem'" in second.stderr
    assert httpx.get(f"{cluster.base_url}/health/ready", timeout=60).status_code == 200  # the first one is fine


def test_bad_requests_get_4xx_and_the_server_keeps_serving(cluster):
    server = cluster
    url, hdr = f"{server.base_url}/v1/chat/completions", server.headers()
    good = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    long_text = " ".join(["token"] * (MAX_PROMPT_TOKENS + 200))
    cases = [
        ("invalid json", dict(content=b"{not json", headers={**hdr, "content-type": "application/json"}), 400),
        ("missing messages", dict(json={"model": "smollm2"}, headers=hdr), 400),
        ("max_tokens 0", dict(json={**good, "max_tokens": 0}, headers=hdr), 400),
        ("max_tokens beyond context", dict(json={**good, "max_tokens": 5000}, headers=hdr), 400),
        ("negative temperature", dict(json={**good, "temperature": -0.5}, headers=hdr), 400),
        ("unknown model", dict(json={**good, "model": "gpt-9"}, headers=hdr), 404),
        ("over-long prompt", dict(json={**good, "messages": [{"role": "user", "content": long_text}]}, headers=hdr),
         400),
        ("oversized body", dict(json={**good, "messages": [{"role": "user", "content": "x" * (2 * MAX_BODY_BYTES)}]},
                                headers=hdr), 413),
        ("no api key", dict(json=good), 401),
    ]
    for name, kwargs, status in cases:
        resp = httpx.post(url, timeout=60, **kwargs)
        assert resp.status_code == status, (name, resp.status_code, resp.text)
        err = resp.json()["error"]
        assert set(err) >= {"message", "type", "param", "code"} and err["message"], (name, err)
    resp = httpx.post(url, json=good, headers=hdr, timeout=120)
    assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"]


def test_client_disconnect_aborts_and_releases_kv_everywhere(cluster):
    server = cluster
    body = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", f"{server.base_url}/v1/completions", json=body, headers=server.headers()) as resp:
            assert resp.status_code == 200
            frames = 0
            for line in resp.iter_lines():
                frames += line.startswith("data: ")
                if frames >= 3:
                    break  # leave mid-stream: closing the response drops the connection
    t0 = time.monotonic()
    found = wait_workers_at_rest(server, timeout_s=30)
    # 1500 tokens take minutes on this CPU: being at rest this soon means the request was aborted.
    assert time.monotonic() - t0 < 30
    assert {w["role"] for w in found} == {"prefill", "decode"}


def test_random_traffic_with_disconnects_leaks_nothing(cluster):
    """28 requests at once: streaming or not, random lengths, a third of the streams dropped by
    the client at a random point; afterwards every worker is at rest with integrity intact."""
    server = cluster
    rng = random.Random(21)
    plans = [dict(stream=rng.random() < 0.7, max_tokens=rng.randrange(1, 28), leave_after=rng.randrange(1, 6),
                  drop=rng.random() < 0.35, words=rng.randrange(1, 80)) for _ in range(28)]

    async def one(http: httpx.AsyncClient, i: int, plan: dict) -> str:
        body = {"model": "smollm2", "prompt": f"{i}: " + "memory page " * plan["words"], "ignore_eos": True,
                "max_tokens": plan["max_tokens"], "temperature": 0.7, "seed": i, "stream": plan["stream"]}
        url = f"{server.base_url}/v1/completions"
        if not plan["stream"]:
            resp = await http.post(url, json=body)
            return "ok" if resp.status_code == 200 else f"status {resp.status_code}"
        async with http.stream("POST", url, json=body) as resp:
            frames = 0
            async for line in resp.aiter_lines():
                frames += line.startswith("data: ")
                if plan["drop"] and frames >= plan["leave_after"]:
                    return "dropped"
            return "ok" if resp.status_code == 200 else f"status {resp.status_code}"

    async def traffic() -> list[str]:
        async with httpx.AsyncClient(timeout=300, headers=server.headers()) as http:
            return await asyncio.gather(*(one(http, i, plan) for i, plan in enumerate(plans)))

    outcomes = asyncio.run(traffic())
    assert set(outcomes) <= {"ok", "dropped"}, outcomes
    assert outcomes.count("dropped") >= 3
    wait_workers_at_rest(server, timeout_s=60)


def test_cache_aware_keeps_a_shared_prefix_on_one_prefill_worker(client, cluster):
    server = cluster
    rng = random.Random(5)
    words = ["cache", "page", "token", "prefill", "decode", "memory", "transfer", "engine", "layer", "batch"]
    system = "You are a terse assistant. Context: " + " ".join(rng.choice(words) for _ in range(300))
    routed = []
    cached = []
    for i in range(4):
        before = server.metrics()
        resp = client.chat.completions.create(
            model="smollm2", max_tokens=4, temperature=0,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": f"Question {i}: why?"}])
        cached.append(resp.usage.prompt_tokens_details.cached_tokens)
        after = server.metrics()
        routed.append([w for w in ("prefill-0", "prefill-1")
                       if metric(after, "tandem:requests_routed_total", prefill_worker=w)
                       > metric(before, "tandem:requests_routed_total", prefill_worker=w)])
    assert all(len(r) == 1 for r in routed), routed
    assert len({r[0] for r in routed}) == 1, f"a shared prefix was spread over prefill workers: {routed}"
    assert all(c >= 256 for c in cached[1:]), f"later requests should hit the prefix cache: {cached}"


def test_killing_a_prefill_worker_mid_transfer_reroutes_its_requests(cluster):
    """Requests whose KV was being computed or shipped by the killed prefill worker have sent no
    token yet: they are re-routed and finish with the same greedy text as after the recovery."""
    server = cluster
    rng = random.Random(11)
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta"]
    prompts = [f"Story {i}: " + " ".join(rng.choice(words) for _ in range(500)) for i in range(4)]
    body = lambda prompt: {"model": "smollm2", "prompt": prompt, "max_tokens": 6, "temperature": 0}  # noqa: E731
    victim = next(w for w in workers(server) if w["worker_id"] == "prefill-0")
    before = server.metrics()

    async def under_kill() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=300, headers=server.headers()) as http:
            tasks = [asyncio.create_task(http.post(f"{server.base_url}/v1/completions", json=body(p)))
                     for p in prompts]
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # wait until the victim is busy with some of them
                stats = next(w for w in workers(server) if w["worker_id"] == "prefill-0")["stats"]
                if stats and (stats["num_running"] or stats["num_transfers"]):
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("prefill-0 never got busy")
            os.kill(victim["pid"], signal.SIGKILL)
            return await asyncio.gather(*tasks)

    responses = asyncio.run(under_kill())
    assert [r.status_code for r in responses] == [200] * 4, [r.text for r in responses]
    texts = [r.json()["choices"][0]["text"] for r in responses]
    assert metric(server.metrics(), "tandem:request_reroutes_total") > metric(before, "tandem:request_reroutes_total")
    found = wait_workers_at_rest(server, timeout_s=180)
    assert next(w for w in found if w["worker_id"] == "prefill-0")["incarnation"] == victim["incarnation"] + 1
    again = [httpx.post(f"{server.base_url}/v1/completions", json=body(p), headers=server.headers(), timeout=300)
             for p in prompts]
    assert [r.json()["choices"][0]["text"] for r in again] == texts
    wait_workers_at_rest(server)


def test_killing_a_prefill_worker_after_the_first_tokens_loses_no_stream(cluster):
    """Once every stream has its first token its KV has landed: a prefill worker SIGKILLed then costs
    none of them a token (each is the undisturbed text), and the controller brings it back."""
    server = cluster
    victim = next(w for w in workers(server) if w["worker_id"] == "prefill-0")
    undisturbed = seeded_streams(server.base_url, API_KEY, 6)
    faulted = seeded_streams(server.base_url, API_KEY, 6, lambda: os.kill(victim["pid"], signal.SIGKILL))
    assert [text for text, _, _ in faulted] == [text for text, _, _ in undisturbed]
    found = wait_workers_at_rest(server, timeout_s=180)
    assert next(w for w in found if w["worker_id"] == "prefill-0")["incarnation"] == victim["incarnation"] + 1


def test_killing_the_decode_worker_mid_stream_loses_no_stream(cluster):
    """The only decode worker SIGKILLed under 8 seeded sampled streams: each waits for the worker's
    restart and resumes there after the tokens it had streamed, so every stream completes with the
    text of the same request undisturbed (run first) and its usage; the survivors hold no page."""
    server = cluster
    decode = next(w for w in workers(server) if w["worker_id"] == "decode-0")
    undisturbed = seeded_streams(server.base_url, API_KEY, 8)
    before = server.metrics()
    # a crash, no goodbye, mid-stream
    faulted = seeded_streams(server.base_url, API_KEY, 8, lambda: os.kill(decode["pid"], signal.SIGKILL))
    assert [text for text, _, _ in faulted] == [text for text, _, _ in undisturbed]
    assert all(not text.startswith("error") and tokens == 32 for text, tokens, _ in faulted), faulted
    resumed = metric(server.metrics(), "tandem:request_migrations_total", outcome="resumed") - \
        metric(before, "tandem:request_migrations_total", outcome="resumed")
    assert resumed >= 1, "no stream was resumed: the kill came too late"
    assert max(gap for _, _, gap in faulted) > max(gap for _, _, gap in undisturbed)  # they did wait
    found = wait_workers_at_rest(server)
    reborn = next(w for w in found if w["worker_id"] == "decode-0")
    assert reborn["incarnation"] == 2 and reborn["restarts"] == 1 and reborn["pid"] != decode["pid"]
    assert metric(server.metrics(), "tandem:worker_restarts", worker="decode-0") == 1


def migrations_resumed(server) -> float:
    return metric(server.metrics(), "tandem:request_migrations_total", outcome="resumed")


def test_sigterm_to_the_decode_worker_drains_it_before_it_stops(cluster):
    """SIGTERM (a node drained, a pod deleted) mid-stream: the worker is drained, not killed: with no
    peer its streams run on there to their end (none needs resuming), then the controller stops it
    and starts the next incarnation."""
    server = cluster
    decode = next(w for w in workers(server) if w["worker_id"] == "decode-0")
    undisturbed = seeded_streams(server.base_url, API_KEY, 6)
    before = migrations_resumed(server)
    drained = seeded_streams(server.base_url, API_KEY, 6, lambda: os.kill(decode["pid"], signal.SIGTERM))
    assert [text for text, _, _ in drained] == [text for text, _, _ in undisturbed]
    assert migrations_resumed(server) == before, "a stream was resumed: SIGTERM killed the worker undrained"
    eventually(lambda: any(w["worker_id"] == "decode-0" and w["incarnation"] > decode["incarnation"]
                           for w in workers(server)), "the drained worker's next incarnation", timeout_s=120)
    found = wait_workers_at_rest(server, timeout_s=120)
    reborn = next(w for w in found if w["worker_id"] == "decode-0")
    assert reborn["incarnation"] == decode["incarnation"] + 1 and reborn["pid"] != decode["pid"]
    assert reborn["restarts"] == decode["restarts"]  # asked for: no crash counted


def test_a_rolling_restart_loses_no_stream_and_holds_new_requests(cluster, capsys):
    """`tandem restart` (POST /admin/restart) of the only decode worker, then a prefill worker, under
    seeded streams: each stream is the undisturbed text (they ran on while the decode worker drained,
    then resumed on its next incarnation); a request sent while it drains waits for it and gets the
    greedy answer, not a 503; every restarted worker is a new incarnation."""
    server = cluster
    before = {w["worker_id"]: w for w in workers(server)}
    undisturbed = seeded_streams(server.base_url, API_KEY, 6, max_tokens=40)
    prompt = {"model": "smollm2", "prompt": RAW_PROMPT, "max_tokens": 8, "temperature": 0}
    expected = httpx.post(f"{server.base_url}/v1/completions", json=prompt, headers=server.headers(), timeout=60)
    codes, held = [], []

    def restart() -> None:
        import threading

        def ask_meanwhile() -> None:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not any(w["draining"] for w in workers(server)
                                                          if w["worker_id"] == "decode-0"):
                time.sleep(0.1)
            held.append(httpx.post(f"{server.base_url}/v1/completions", json=prompt, headers=server.headers(),
                                   timeout=120))
        asker = threading.Thread(target=ask_meanwhile)
        asker.start()
        codes.append(tandem_main(["restart", "--url", server.base_url, "--api-key", API_KEY,
                                  "--workers", "decode-0,prefill-1", "--drain-timeout-s", "1"]))
        asker.join()

    faulted = seeded_streams(server.base_url, API_KEY, 6, restart, max_tokens=40)
    assert codes == [0]
    assert [text for text, _, _ in faulted] == [text for text, _, _ in undisturbed]
    assert held and held[0].status_code == 200, held[0].text if held else "no request was sent while it drained"
    assert held[0].json()["choices"][0]["text"] == expected.json()["choices"][0]["text"]
    reports = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [(r["worker_id"], r["restarted"]) for r in reports] == [("decode-0", True), ("prefill-1", True)]
    found = {w["worker_id"]: w for w in wait_workers_at_rest(server, timeout_s=120)}
    for wid in ("prefill-1", "decode-0"):
        assert found[wid]["incarnation"] == before[wid]["incarnation"] + 1, found[wid]
    assert found["prefill-0"]["incarnation"] == before["prefill-0"]["incarnation"]
