"""Prefill worker -> LocalTransport -> decode worker's landing pool -> device, in one process, relayed by
the dispatcher `tandem serve` runs: `WorkerHost`s (loop threads) built by `build_worker` with a
`LocalTransport` each (peers find each other by session id) and the tiny Llama in place of a
loaded model."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import random
import time

import pytest

from cluster.worker_host.build import make_worker
from cluster.worker_host.thread import WorkerHost
from common import protocol as p
from common.config import EngineConfig
from kv_store.transfer.config import TransportConfig
from kv_store.transfer.local import LocalTransport
from router.backend import ErrorKind
from tests import dispatch_harness
from tests.debug_worker import DigestKV, KVDigest, build_debug_worker
from tests.dispatch_harness import REST_SETTLE_S, RecordingLink, queue_all, run, start_hosts, stop_hosts
from tests.helpers import greedy, hf_greedy, make_engine, make_prompts, tiny_models


@pytest.fixture
def make_hosts():
    made = []

    def make(page_size=4, chunk_size=16, num_pages=256, host_pages=256, deadlines=TransportConfig()):
        config = EngineConfig(page_size=page_size, num_pages=num_pages, chunk_size=chunk_size, debug_kv=True)
        made.append(start_hosts(config, (("prefill-0", "prefill", 0), ("decode-0", "decode", host_pages)),
                                build_debug_worker, transport=deadlines))
        return made[-1]

    yield make
    for hosts in made:
        stop_hosts(hosts)


class TapLink(RecordingLink):
    """`RecordingLink` that keeps KV digests (a test hook's replies) away from the dispatcher."""

    def __init__(self, host: WorkerHost):
        super().__init__(host)
        self.digests = []

    async def collect(self, timeout_s: float) -> list:
        msgs = await super().collect(timeout_s)
        self.digests += [m for m in msgs if isinstance(m, KVDigest)]
        return [m for m in msgs if not isinstance(m, KVDigest)]


serve = functools.partial(dispatch_harness.serve, link=TapLink)


async def fresh_stats(host: WorkerHost) -> p.WorkerStats:
    asked = time.time()
    while host.conn.stats is None or host.conn.stats_unix_s <= asked:
        await asyncio.sleep(0.01)
    return host.conn.stats


async def at_rest(*hosts: WorkerHost, timeout_s: float = 10.0, pump=lambda: None) -> None:
    """No PRIVATE or IN_FLIGHT page, landing pool all free, no transfer, integrity OK (the workers' own
    stats), at two looks `REST_SETTLE_S` apart (an answer's prefill, sent as a request ended, may
    reach the prefill worker just after it looked idle). `pump` runs before each look (e.g. ends
    writes a stalled transport still holds)."""
    deadline = time.monotonic() + timeout_s
    for look in range(2):
        for host in hosts:
            while True:
                pump()
                s = await fresh_stats(host)
                if (s.device.private == s.device.in_flight == s.num_transfers == s.num_running == 0
                        and (s.landing is None or s.landing.free == s.landing.total)):
                    break
                assert time.monotonic() < deadline, f"{host.worker_id} not at rest: {s}"
            assert not s.integrity_error, s.integrity_error
        if not look:
            await asyncio.sleep(REST_SETTLE_S)


async def kv_digests(d, views, hosts, prompt: list[int], full: int) -> list[KVDigest]:
    """Serve `prompt` (5 tokens), then each worker's digest of its first `full` KV pages, at rest."""
    await run(d, "kv", prompt, greedy(max_tokens=5))
    for wid in hosts:
        await views.links[wid].send([DigestKV(tuple(prompt), full)])
        while not views.links[wid].digests:
            await asyncio.sleep(0.01)
    await at_rest(*hosts.values())
    return [views.links[wid].digests[0] for wid in hosts]


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_disaggregated_greedy_matches_colocated_and_hf(make_hosts, prompts, hf_outputs, page_size):
    chunk = 16
    assert max(map(len, prompts)) >= 3 * chunk  # the longest prompt crosses >= 3 chunks
    hosts = make_hosts(page_size=page_size, chunk_size=chunk)

    async def scenario(d, views):
        results = await asyncio.gather(*(run(d, f"g{i}", pr, greedy(max_tokens=24)) for i, pr in enumerate(prompts)))
        await at_rest(*hosts.values())
        return results

    results = serve(hosts, scenario)
    colocated = make_engine(page_size=page_size, chunk_size=chunk).generate(prompts, greedy(max_tokens=24))
    assert [r[0] for r in results] == [r.output_token_ids for r in colocated] == hf_outputs
    assert all(last.finish_reason == "length" and not last.error and last.prefill_worker == "prefill-0"
               for _, last in results)


def test_decode_kv_is_byte_identical_to_prefill_kv(make_hosts, prompts):
    hosts = make_hosts(page_size=4, chunk_size=16)
    prompt = prompts[4]
    full = len(prompt) // 4
    assert full >= 4

    async def scenario(d, views):
        return await kv_digests(d, views, hosts, prompt, full)

    prefill, decode = serve(hosts, scenario)
    assert prefill.num_pages == decode.num_pages == full
    assert prefill.sha256 and prefill.sha256 == decode.sha256


@pytest.fixture
def staged(monkeypatch):
    """Prefill workers ship through host staging, as one whose KV pool is GPU memory does: the pool
    reads as not host-readable (a device range is not) where the sender decides, and staging holds
    one prefill chunk of pages, so a longer prompt goes in pieces as pages free up."""
    import common.config
    import prefill_worker.staging as staging

    monkeypatch.setattr(staging, "is_host_readable", lambda addr, length: False)
    monkeypatch.setattr(common.config, "STAGING_CHUNKS", 1)


@pytest.fixture(params=["in_place", "staged"])
def shipping(request):
    """Both ways a prefill worker ships: from its KV pool in place, and through host staging."""
    if request.param == "staged":
        request.getfixturevalue("staged")
    return request.param


@pytest.mark.usefixtures("staged")
def test_staged_shipping_lands_the_same_kv_and_registers_only_staging(make_hosts, prompts, hf_outputs):
    """Through staging: HF's greedy tokens and a byte-identical KV on the decode side for prompts of
    up to 4 staging pools, the prefill transport's regions are the staging pages and never the KV
    pool, and every staging page is free again at rest."""
    hosts = make_hosts(page_size=4, chunk_size=16)
    prefill = hosts["prefill-0"]
    sender = prefill.worker.inner.engine.connector
    assert sender.staging is not None and sender.staging.num_pages == 4
    assert max(map(len, prompts)) > 3 * 4 * 4  # the longest prompt crosses the staging pool 3 times
    regions = [(r.addr, r.end) for r in prefill.transport._regions.regions()]
    pool = sender.kv_cache
    for t in (*pool.k, *pool.v):
        assert all(end <= t.data_ptr() or start >= t.data_ptr() + t.numel() * t.element_size()
                   for start, end in regions), "the KV pool was registered with the transport"
    staging_bytes = sum(t.numel() * t.element_size() for t in (*sender.staging.kv.k, *sender.staging.kv.v))
    assert sum(end - start for start, end in regions) == staging_bytes

    prompt = prompts[4]
    full = len(prompt) // 4

    async def scenario(d, views):
        results = await asyncio.gather(*(run(d, f"s{i}", pr, greedy(max_tokens=24)) for i, pr in enumerate(prompts)))
        return results, await kv_digests(d, views, hosts, prompt, full)

    results, (prefill_kv, decode_kv) = serve(hosts, scenario)
    assert [r[0] for r in results] == hf_outputs
    assert prefill_kv.num_pages == decode_kv.num_pages == full and prefill_kv.sha256 == decode_kv.sha256
    assert sender.staging.num_free == sender.staging.num_pages
    sender.check_integrity()


def test_stall_trips_deadline_and_both_sides_release(make_hosts, prompts):
    hosts = make_hosts(deadlines=TransportConfig(waiting_s=0.5, transferring_s=0.5))
    hosts["prefill-0"].transport.stall_next(100)

    async def scenario(d, views):
        _, last = await run(d, "stuck", prompts[4], greedy(max_tokens=5))
        stats = await fresh_stats(hosts["decode-0"])
        assert stats.landing.in_flight > 0, "landing freed while the stalled writes could still land"
        assert (await fresh_stats(hosts["prefill-0"])).device.in_flight > 0  # pages lent to the stalled writes
        hosts["prefill-0"].transport.release_stalled(fail=True)  # the stalled writes end
        await at_rest(*hosts.values())
        return last

    last = serve(hosts, scenario, max_transfer_retries=0)
    assert last.finish_reason == "abort" and "timeout" in last.error and last.error_kind is ErrorKind.UNAVAILABLE


def test_failed_transfer_is_rerouted_or_typed_and_next_request_succeeds(shipping, make_hosts, prompts, hf_outputs):
    hosts = make_hosts()

    async def scenario(d, views):
        hosts["prefill-0"].transport.fail_next(1)
        rerouted = await run(d, "a", prompts[5], greedy(max_tokens=24))  # re-routed: served on the second try
        assert d.reroutes._value.get() == 1
        d.config = dataclasses.replace(d.config, max_transfer_retries=0)
        hosts["prefill-0"].transport.fail_next(1)
        failed = await run(d, "b", prompts[5], greedy(max_tokens=24))
        ok = await run(d, "c", prompts[5], greedy(max_tokens=24))
        await at_rest(*hosts.values())
        return rerouted, failed, ok

    rerouted, failed, ok = serve(hosts, scenario)
    assert rerouted[0] == hf_outputs[5] and not rerouted[1].error
    assert failed[1].finish_reason == "abort" and "transport_error" in failed[1].error
    assert ok[0] == hf_outputs[5] and not ok[1].error


def test_client_abort_mid_transfer_and_dead_prefill_peer(shipping, make_hosts, prompts, hf_outputs):
    hosts = make_hosts(chunk_size=8)
    prefill = hosts["prefill-0"]

    async def scenario(d, views):
        prefill.transport.stall_next(100)
        stream = d.generate("a", prompts[4], greedy(max_tokens=5))
        while not any(isinstance(m, p.Prefill) for m in views.links["prefill-0"].sent):
            await asyncio.sleep(0.01)
        await d.abort("a")
        await stream.aclose()
        await at_rest(*hosts.values(), pump=prefill.transport.release_stalled)  # writes until the abort landed
        prefill.transport.stall_next(100)
        # The prefill worker dies while its writes hang: the decode side frees the landing on the
        # dispatcher's PeerDead and the request is re-routed to local prefill.
        task = asyncio.create_task(run(d, "b", prompts[4], greedy(max_tokens=24)))
        while (await fresh_stats(hosts["decode-0"])).landing.in_flight == 0:
            await asyncio.sleep(0.01)
        views.dead.add("prefill-0")
        tokens, last = await task
        # The in-process host outlives its "death"; a dead process would compute and write nothing more.
        prefill.deliver([p.AbortTransfer("b.0", "test: this worker is dead")])
        await at_rest(*hosts.values(), pump=lambda: prefill.transport.release_stalled(fail=True))
        return tokens, last

    tokens, last = serve(hosts, scenario)
    assert tokens == hf_outputs[4] and not last.error and last.prefill_worker == ""


def test_200_random_requests_with_aborts_leak_nothing(shipping, make_hosts):
    rng = random.Random(5)
    hosts = make_hosts(page_size=4, chunk_size=24, num_pages=1 + 256 // 4, host_pages=1 + 192 // 4)
    prompts = make_prompts(200, min_len=2, max_len=60, seed=9)
    max_tokens = {f"r{i}": rng.randrange(1, 12) for i in range(len(prompts))}

    async def scenario(d, views):
        tasks, aborted = {}, set()
        for i, prompt in enumerate(prompts):
            tasks[f"r{i}"] = asyncio.create_task(run(d, f"r{i}", prompt, greedy(max_tokens=max_tokens[f"r{i}"])))
            await asyncio.sleep(rng.random() * 0.004)
            live = [rid for rid, t in tasks.items() if not t.done()]
            if live and rng.random() < 0.15:
                rid = rng.choice(live)
                aborted.add(rid)
                await d.abort(rid)  # the gateway's order on a disconnect: abort, then stop reading
                tasks[rid].cancel()
        results = {rid: await t for rid, t in tasks.items() if rid not in aborted}
        assert not d.flights
        await at_rest(*hosts.values())
        return results, aborted

    results, aborted = serve(hosts, scenario, admission=queue_all(len(prompts)), max_pending=len(prompts))
    assert len(aborted) >= 20
    done = list(results)
    assert all(not results[rid][1].error for rid in done), [results[rid][1].error for rid in done][:3]
    reference = make_engine(page_size=4, num_pages=2048).generate(
        [prompts[int(rid[1:])] for rid in done], [greedy(max_tokens=max_tokens[rid]) for rid in done])
    assert [results[rid][0] for rid in done] == [r.output_token_ids for r in reference]


def test_slow_but_moving_transfer_outlives_its_deadline(make_hosts, prompts, hf_outputs, monkeypatch):
    """Progress restarts the deadline on both sides: every prefill chunk (and so every write) comes
    within the deadline, but the whole transfer takes several deadlines."""
    from kernels.model.llama import LlamaForCausalLM

    deadline_s, chunk_s = 0.6, 0.25
    real_forward = LlamaForCausalLM.forward

    def slow_prefill(self, input_ids, *args, **kw):
        if input_ids.numel() > 1:  # a prefill chunk (the decode batch here is one token)
            time.sleep(chunk_s)
        return real_forward(self, input_ids, *args, **kw)

    monkeypatch.setattr(LlamaForCausalLM, "forward", slow_prefill)
    hosts = make_hosts(chunk_size=8, deadlines=TransportConfig(waiting_s=deadline_s, transferring_s=deadline_s))
    assert len(prompts[4]) > 6 * 8  # 7 chunks

    async def scenario(d, views):
        return await run(d, "slow", prompts[4], greedy(max_tokens=24))

    tokens, last = serve(hosts, scenario)
    assert tokens == hf_outputs[4] and not last.error
    assert last.kv_transfer_s > 2 * deadline_s  # the whole transfer took several deadlines


def test_a_prompt_larger_than_the_whole_landing_pool_is_prefilled_on_the_decode_worker(make_hosts):
    """The landing does not cap the context: a prompt it cannot hold is prefilled where it decodes
    (HF's tokens), one it holds still crosses from the prefill worker; the decode worker's limit is
    its engine's, not its landing's."""
    hosts = make_hosts(page_size=4, host_pages=1 + 3)  # 3 usable landing pages: 12 tokens
    decode = hosts["decode-0"].worker.inner
    assert decode.max_request_tokens() == decode.engine.max_request_tokens() > 12
    big_prompt, fits_prompt = list(range(3, 16)), list(range(3, 15))
    _, hf, _ = tiny_models()

    async def scenario(d, views):
        await fresh_stats(hosts["decode-0"])  # its landing is reported with its heartbeats
        await asyncio.sleep(0.1)  # the dispatcher's views refresh every 20 ms
        big = await run(d, "big", big_prompt, greedy(max_tokens=2))
        fits = await run(d, "fits", fits_prompt, greedy(max_tokens=2))
        await at_rest(*hosts.values())
        return big, fits

    big, fits = serve(hosts, scenario)
    assert big[0] == hf_greedy(hf, big_prompt, 2) and not big[1].error and big[1].prefill_worker == ""
    assert fits[0] == hf_greedy(hf, fits_prompt, 2) and not fits[1].error, fits[1]
    assert fits[1].prefill_worker == "prefill-0", fits[1]


@pytest.mark.parametrize("prefill_answers", [True, False])
def test_a_finished_answer_is_prefilled_where_its_prompt_was_so_the_next_turn_finds_its_history(
        make_hosts, prompts, prefill_answers):
    """The decode worker computed the answer's KV; the prefill worker, which the next turn goes to,
    computes it too (`PrefillAnswer`), so the next turn's prompt (prompt, answer, new message) is
    cached up to the answer's last whole page instead of the first prompt's."""
    hosts = make_hosts(page_size=4, chunk_size=16)
    first = prompts[4]
    _, ref, _ = tiny_models()

    async def scenario(d, views):
        answer, _ = await run(d, "t1", first, greedy(max_tokens=13))
        await at_rest(*hosts.values())  # the answer's prefill (if sent) has run and been released
        turn_two = first + answer + [5, 6, 7, 8, 9]
        out, last = await run(d, "t2", turn_two, greedy(max_tokens=8))
        await at_rest(*hosts.values())
        return answer, turn_two, out, last, d.answers.counter._value.get()

    answer, turn_two, out, last, answers_sent = serve(hosts, scenario, prefill_answers=prefill_answers)
    assert len(answer) == 13 and out == hf_greedy(ref, turn_two, 8)
    history = len(first) + len(answer) - 1  # the answer's last token has no KV
    cached = history // 4 * 4 if prefill_answers else len(first) // 4 * 4
    assert history // 4 > len(first) // 4 and last.cached_tokens == cached
    assert answers_sent == (2 if prefill_answers else 0)  # both turns' answers, or none


def test_an_answer_is_prefilled_only_past_a_prompt_still_cached_and_at_most_one_chunk_of_it():
    ours, _, arch = tiny_models()
    worker = make_worker("prefill", EngineConfig(page_size=4, num_pages=64, chunk_size=16, debug_kv=True), ours, arch,
                           LocalTransport())
    engine, tree = worker.engine, worker.engine.kvm.prefix_cache
    prompt = make_prompts(1, min_len=30, max_len=30, seed=5)[0]
    engine.generate([prompt], greedy(max_tokens=1))  # a prompt this worker prefilled: 28 tokens cached
    answer = [7] * 40

    def cached_after(request_id: str, token_ids: list[int], prompt_len: int = 30) -> tuple[bool, int]:
        queued = worker.prefill_answer(request_id, token_ids, prompt_len)
        while engine.busy():
            engine.step()
        return queued, tree.cached_len(token_ids)

    assert cached_after("a0", prompt + answer[:1]) == (False, 28)  # 31 tokens: no whole page past the prompt's
    assert cached_after("a1", prompt + answer[:9]) == (True, 36)
    assert cached_after("a2", prompt + answer) == (True, 36 + 16)  # 32 tokens left: one chunk of them
    assert cached_after("a3", [9] * 30 + answer, 30) == (False, 0)  # its prompt is not cached: nothing recomputed
    worker.check_integrity()
    worker.close()


def test_a_landed_page_corrupted_in_transfer_is_never_served_the_prompt_is_computed_again(make_hosts, prompts,
                                                                                          hf_outputs, shipping):
    """A byte flipped in a landing page by the transport (no transport error reports it): the decode
    worker's checksum check fails the request as a transfer before its first token, the dispatcher
    re-routes it, and the client gets transformers' tokens; the failure is counted and logged. Both
    ways a prefill worker ships: the sums of a staged transfer are its staged copies'."""
    hosts = make_hosts()

    async def scenario(d, views):
        hosts["prefill-0"].transport.corrupt_next(1)
        got = await run(d, "corrupt", prompts[5], greedy(max_tokens=24))
        await at_rest(*hosts.values())
        stats = await fresh_stats(hosts["decode-0"])
        return got, d.reroutes._value.get(), stats.tiers.transfer_corrupt

    (tokens, last), reroutes, corrupt = serve(hosts, scenario)
    assert tokens == hf_outputs[5] and not last.error
    assert reroutes == 1 and corrupt == 1
