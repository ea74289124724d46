"""Disaggregated serving across real processes: the dispatcher `tandem serve` runs, over a prefill
and a decode worker process (`ProcessViews`, Mooncake TCP on 127.0.0.1), with SmolLM2-135M-Instruct.
Workers are started and stopped by the tests."""

import asyncio
import json
import random
import time

import pytest

from cluster.worker_host.process import ProcessViews, complete, offline_dispatcher, pair_specs
from common.config import EngineConfig, SamplingParams
from kv_store.transfer.config import TransportConfig
from tests.debug_worker import DigestKV, KVDigest, Stall, build_debug_worker
from tests.helpers import CHAT_PROMPTS, greedy, hf_greedy, make_smollm2_engine, smollm2

pytestmark = pytest.mark.slow
MAX_NEW = 16


def apply_chat(prompt):
    from kernels.model.tokenizer import apply_chat_template

    return apply_chat_template(smollm2()[0].tokenizer, prompt)


@pytest.fixture(scope="module")
def chat_ids():
    return [apply_chat(p) for p in CHAT_PROMPTS]


@pytest.fixture(scope="module")
def hf_outputs(chat_ids):
    loaded, ref = smollm2()
    return [hf_greedy(ref, ids, MAX_NEW, eos_token_id=list(loaded.eos_token_ids)) for ids in chat_ids]


def long_prompt(num_words=900):
    rng = random.Random(3)
    words = ["cache", "page", "token", "prefill", "decode", "memory", "transfer", "engine", "request", "layer"]
    return apply_chat("Summarize: " + " ".join(rng.choice(words) for _ in range(num_words)))


def at_rest(stats) -> bool:
    host_ok = stats.landing is None or stats.landing.free == stats.landing.total
    return (stats.device.private == 0 and stats.device.in_flight == 0 and stats.num_transfers == 0
            and host_ok and not stats.integrity_error)


async def wait_for(views, worker_id, predicate, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    stats = None
    while time.monotonic() < deadline:
        stats = await views.stats(worker_id)
        if predicate(stats):
            return stats
    raise AssertionError(f"{worker_id}: {what} not reached within {timeout_s}s; last stats {stats}")


async def both_at_rest(views, what="pools at rest", timeout_s=30):
    for wid in ("prefill-0", "decode-0"):
        await wait_for(views, wid, at_rest, timeout_s, what)


@pytest.fixture
def make_views():
    made = []

    def make(page_size=16, chunk_size=32, transport=None, num_pages=1024, host_pages=1024, heartbeat_timeout_s=5.0):
        config = EngineConfig(page_size=page_size, chunk_size=chunk_size, num_pages=num_pages, debug_kv=True)
        views = ProcessViews(pair_specs(config, None, host_pages, transport), build=build_debug_worker,
                             aside=lambda msg: isinstance(msg, KVDigest), heartbeat_timeout_s=heartbeat_timeout_s)
        made.append(views)
        return views

    yield make
    for views in made:
        views.close()


def serve(views, scenario, **kw):
    """`await scenario(dispatcher)` on a fresh loop, with a dispatcher over `views` closed afterwards."""
    async def main():
        d = offline_dispatcher(views, 256, 8192, **{"refresh_interval_s": 0.1, "collect_timeout_s": 0.1, **kw})
        await d.start()
        try:
            return await asyncio.wait_for(scenario(d), 300)
        finally:
            await d.close()
    return asyncio.run(main())


@pytest.mark.parametrize("page_size", [1, 16])
def test_disaggregated_equals_colocated_equals_hf(make_views, chat_ids, hf_outputs, page_size):
    chunk = 32
    assert max(map(len, chat_ids)) >= 3 * chunk  # the longest prompt takes >= 3 chunks
    views = make_views(page_size=page_size, chunk_size=chunk)

    async def scenario(d):
        done = await asyncio.gather(*(complete(d, f"eq-{i}", ids, greedy(max_tokens=MAX_NEW))
                                      for i, ids in enumerate(chat_ids)))
        await both_at_rest(views)
        return done

    results = serve(views, scenario)
    colocated = make_smollm2_engine(page_size=page_size, chunk_size=chunk).generate(chat_ids,
                                                                                    greedy(max_tokens=MAX_NEW))
    assert [r.token_ids for r in results] == [r.output_token_ids for r in colocated] == hf_outputs
    assert all(not r.error for r in results)
    # `tandem bench transfer` builds its TTFT breakdown from these, carried on the last chunk
    needed = {"prefill_submitted", "compute_done", "first_write", "transfer_done", "load_start", "load_done"}
    assert all(needed <= set(r.timings) for r in results), results[0].timings


def test_kill_decode_mid_transfer_prefill_releases_everything(make_views):
    views = make_views(chunk_size=32, transport=TransportConfig(transferring_s=10), heartbeat_timeout_s=3)

    async def scenario(d):
        task = asyncio.create_task(complete(d, "long", long_prompt(), greedy(max_tokens=4)))
        await wait_for(views, "prefill-0", lambda s: s.num_transfers == 1 and s.device.private + s.device.in_flight > 0,
                       60, "a transfer in progress")
        views.kill("decode-0")
        req = await asyncio.wait_for(task, 30)
        stats = await wait_for(views, "prefill-0", at_rest, 30, "all pages FREE or CACHED after the decode worker died")
        assert stats.device.free + stats.device.cached == stats.device.total
        assert d.lives["decode-0"].gone
        return req

    req = serve(views, scenario)
    assert req.finish_reason == "abort" and "decode-0 died" in req.error


def test_kill_prefill_mid_transfer_reroutes_to_local_prefill(make_views, chat_ids, hf_outputs):
    """As under `tandem serve`: the failed transfer is re-routed, and with no prefill worker left the
    decode worker prefills it itself; the client sees only the right tokens."""
    views = make_views(chunk_size=32, transport=TransportConfig(transferring_s=10), heartbeat_timeout_s=3)
    prompt = long_prompt()

    async def scenario(d):
        task = asyncio.create_task(complete(d, "long", prompt, greedy(max_tokens=4)))
        await wait_for(views, "decode-0", lambda s: s.num_transfers == 1 and s.landing.in_flight > 0, 60,
                       "a landing being written")
        views.kill("prefill-0")
        req = await asyncio.wait_for(task, 120)
        assert d.reroutes._value.get() == 1 and d.lives["prefill-0"].gone
        await wait_for(views, "decode-0", at_rest, 30, "landing pages freed")
        after = await complete(d, "after", chat_ids[1], greedy(max_tokens=MAX_NEW))  # the decode worker alone
        await wait_for(views, "decode-0", at_rest, 10, "pools at rest")
        return req, after

    req, after = serve(views, scenario)
    [expected] = make_smollm2_engine(chunk_size=32).generate([prompt], greedy(max_tokens=4))
    assert not req.error and req.token_ids == expected.output_token_ids
    assert after.token_ids == hf_outputs[1] and not after.error


def test_stall_trips_deadline_and_both_sides_end_clean(make_views, chat_ids, hf_outputs):
    views = make_views(chunk_size=32, transport=TransportConfig(waiting_s=1.5, transferring_s=1.5),
                       heartbeat_timeout_s=10)

    async def scenario(d):
        # a slow peer: stops stepping (and writing) for longer than the deadline
        await views.link("prefill-0").send([Stall(4.0)])
        req = await complete(d, "stalled", chat_ids[4], greedy(max_tokens=4))
        await both_at_rest(views, "pools at rest after the timeout")
        after = await complete(d, "after", chat_ids[1], greedy(max_tokens=MAX_NEW))
        return req, after

    req, after = serve(views, scenario, max_transfer_retries=0)  # no retry: the timeout reaches the client
    assert req.finish_reason == "abort" and "timeout" in req.error
    assert after.token_ids == hf_outputs[1]


def test_a_landing_that_never_comes_times_out_while_the_holder_finishes(make_views, chat_ids, hf_outputs):
    """The decode worker's landing pool holds one prompt: while the first request holds it (its
    prefill worker stalled), the second waits for a landing and fails after `landing_timeout_s`,
    as under `tandem serve`; the first then completes."""
    page = 16
    first, second = chat_ids[4], chat_ids[1]
    assert len(second) <= len(first)
    views = make_views(page_size=page, host_pages=1 + -(-len(first) // page))  # +1: page 0 is the scratch page

    async def scenario(d):
        await views.link("prefill-0").send([Stall(3.0)])
        holder = asyncio.create_task(complete(d, "holder", first, greedy(max_tokens=MAX_NEW)))
        await asyncio.sleep(0.3)  # its landing is reserved first
        started = time.monotonic()
        waiter = await complete(d, "waiter", second, greedy(max_tokens=MAX_NEW))
        waited_s = time.monotonic() - started
        holder = await holder
        await both_at_rest(views)
        return holder, waiter, waited_s

    holder, waiter, waited_s = serve(views, scenario, landing_timeout_s=1.0, reserve_retry_s=0.05)
    assert waiter.finish_reason == "abort" and "room to land" in waiter.error and 1.0 <= waited_s < 3.0
    assert holder.token_ids == hf_outputs[4] and not holder.error


def test_200_random_requests_with_aborts_leak_nothing(make_views):
    rng = random.Random(11)
    views = make_views(page_size=16, chunk_size=256, num_pages=1 + 4096 // 16, host_pages=1 + 2048 // 16)
    vocab = smollm2()[0].arch.vocab_size

    async def scenario(d):
        tasks, params, aborted = {}, {}, set()
        for i in range(200):
            prompt = [rng.randrange(10, vocab) for _ in range(rng.randrange(4, 48))]
            params[f"r{i}"] = SamplingParams(max_tokens=rng.randrange(1, 6), ignore_eos=True)
            tasks[f"r{i}"] = asyncio.create_task(complete(d, f"r{i}", prompt, params[f"r{i}"]))
            if rng.random() < 0.3:
                await asyncio.sleep(0)
            live = [rid for rid, t in tasks.items() if not t.done()]
            if live and rng.random() < 0.2:
                rid = rng.choice(live)
                aborted.add(rid)
                await d.abort(rid)  # the gateway's order on a disconnect: abort, then stop reading
                tasks[rid].cancel()
        done = {rid: await asyncio.wait_for(t, 300) for rid, t in tasks.items() if rid not in aborted}
        assert not d.flights
        await both_at_rest(views, "no page leaked")
        return done, params, aborted

    done, params, aborted = serve(views, scenario)
    assert len(aborted) >= 20
    served = list(done.values())
    assert not any(r.error for r in served), [r.error for r in served if r.error][:3]
    assert all(len(r.token_ids) == params[r.request_id].max_tokens for r in served)


def test_cli_disaggregated_json_equals_colocated(capsys):
    from cluster.cli.main import main

    args = ["run", "--prompt", CHAT_PROMPTS[1], "--prompt", CHAT_PROMPTS[2], "--max-tokens", str(MAX_NEW),
            "--num-pages", "256", "--host-pages", "256", "--json"]
    assert main(args) == 0
    colocated = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert main(args + ["--mode", "disaggregated"]) == 0
    disaggregated = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(colocated) == 2 and disaggregated == colocated


async def kv_digest(views, worker_id: str, token_ids: list[int], num_pages: int) -> KVDigest:
    """The hash of the worker's cached KV for the first `num_pages` pages of `token_ids`."""
    await views.link(worker_id).send([DigestKV(tuple(token_ids), num_pages)])
    return await views.link(worker_id).take_aside(30.0)


def test_decode_kv_is_byte_identical_to_prefill_kv_over_mooncake(make_views):
    views = make_views(page_size=16, chunk_size=64)
    prompt = long_prompt(150)
    full_pages = len(prompt) // 16
    assert full_pages >= 8

    async def scenario(d):
        res = await complete(d, "kv", prompt, greedy(max_tokens=4))
        assert not res.error
        prefill = await kv_digest(views, "prefill-0", prompt, full_pages)
        decode = await kv_digest(views, "decode-0", prompt, full_pages)
        other = await kv_digest(views, "prefill-0", long_prompt(150)[:16] + [7] * 16 * (full_pages - 1), full_pages)
        return prefill, decode, other

    prefill, decode, other = serve(views, scenario)
    assert prefill.num_pages == decode.num_pages == full_pages
    assert prefill.sha256 and prefill.sha256 == decode.sha256
    assert other.sha256 == ""  # a prefix nobody computed is not found: the digest is not vacuous
