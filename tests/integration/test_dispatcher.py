"""The dispatcher over real in-process workers (`WorkerHost`s with SmolLM2, Mooncake TCP on loopback).

One set of hosts serves the whole module (building one costs seconds); each test builds its own
`Dispatcher` over a `Cluster` (a mutable view source naming the hosts it may use), and ends with the
workers at rest. Death is simulated by cutting a worker's link (`send`/`collect` raise, as a dead
actor's would) or by the controller's view; an in-process host keeps running after its "death", so
a test that kills one also stops the work it was doing and returns it to rest for the next test.
Request ids are unique across the module: a later dispatcher may still collect a host's stale
messages, and must find nothing they belong to.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time

import pytest

from cluster.worker_host.build import WorkerSpec
from cluster.worker_host.thread import HostLink, WorkerHost
from common import protocol as p
from common.config import EngineConfig
from common.protocol import WorkerRole
from decode_worker.worker import InboundPhase
from kernels.model.tokenizer import apply_chat_template
from kv_store.kv_manager import ceil_div
from kv_store.transfer.config import TransportConfig
from router.admission import PLAN_SHARE, AdmissionParams
from router.backend import BackendError, ErrorKind
from router.dispatcher import Dispatcher, DispatcherConfig, Phase, WorkerInfo
from tests.debug_worker import Stall, build_debug_worker
from tests.dispatch_harness import settled, wait_for
from tests.helpers import CHAT_PROMPTS, greedy, make_smollm2_engine, why_not_at_rest

pytestmark = pytest.mark.slow

ENGINE = EngineConfig(num_pages=512, chunk_size=64)  # 64-token chunks: a 400-token prompt prefills for seconds
PAGE = ENGINE.page_size
TINY_HOST_PAGES = 3  # usable landing pages of "decode-tiny": one 33..48-token prompt at a time
MAX_NEW = 10
LONG = 200  # max_tokens of a request that must still be running when the test acts on it
REST_TIMEOUT_S = 5.0
# The "-short" pair: a transfer that waits this long for its prefill to start is abandoned.
SHORT_DEADLINES = TransportConfig(bootstrapping_s=30.0, waiting_s=5.0, transferring_s=5.0)


# ---- fixtures ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hosts():
    built = {"prefill-0": WorkerHost(WorkerSpec("prefill", ENGINE), "prefill-0", build=build_debug_worker),
             "decode-0": WorkerHost(WorkerSpec("decode", ENGINE, host_pages=256), "decode-0"),
             # +1: the host pool's page 0 is the scratch page
             "decode-tiny": WorkerHost(WorkerSpec("decode", ENGINE, host_pages=TINY_HOST_PAGES + 1), "decode-tiny"),
             "prefill-short": WorkerHost(WorkerSpec("prefill", ENGINE, transport=SHORT_DEADLINES), "prefill-short"),
             "decode-short": WorkerHost(WorkerSpec("decode", ENGINE, host_pages=256, transport=SHORT_DEADLINES),
                                        "decode-short")}
    yield built
    for host in built.values():
        assert host.shutdown(), f"{host.worker_id}: loop did not stop"
        assert not host.crashed, host.crashed


@pytest.fixture(scope="module")
def tok(hosts):
    return hosts["decode-0"].worker.engine.tokenizer


@pytest.fixture(scope="module")
def reference():
    """Greedy token ids of the colocated engine (same pool shape and chunking), memoised per prompt."""
    engine = make_smollm2_engine(num_pages=ENGINE.num_pages, chunk_size=ENGINE.chunk_size)
    done: dict[tuple, list[int]] = {}

    def run(prompts: list[list[int]], max_tokens: int = MAX_NEW) -> list[list[int]]:
        todo = [pr for pr in prompts if (tuple(pr), max_tokens) not in done]
        for pr, req in zip(todo, engine.generate(todo, greedy(max_tokens=max_tokens))):
            done[tuple(pr), max_tokens] = list(req.output_token_ids)
        return [done[tuple(pr), max_tokens] for pr in prompts]

    return run


@pytest.fixture(scope="module")
def long_prompt(tok):
    text = "Summarize the following text in one sentence: " + "Paged attention stores the key and value " \
        "cache in fixed-size pages so that memory is allocated on demand and shared between requests. " * 13
    ids = apply_chat_template(tok, text)
    assert 350 <= len(ids) <= 500 and len(ids) > 4 * ENGINE.chunk_size, len(ids)
    return ids


def chat(tok, i: int) -> list[int]:
    return apply_chat_template(tok, CHAT_PROMPTS[i])


# ---- a controller's view of the hosts, with links that can be cut ---------------------------------


class Link:
    """`HostLink` that can be cut: `send` and `collect` raise from then on, and what a collect in
    progress brings back is lost, as with a dead process. Records every message it collected."""

    def __init__(self, host: WorkerHost):
        self.inner, self.worker_id = HostLink(host), host.worker_id
        self.cut = False
        self.seen: list = []

    def _check(self) -> None:
        if self.cut:
            raise ConnectionError(f"{self.worker_id} is unreachable")

    async def send(self, msgs: list) -> None:
        self._check()
        await self.inner.send(msgs)

    async def collect(self, timeout_s: float) -> list:
        self._check()
        msgs = await self.inner.collect(timeout_s)
        self._check()
        self.seen += msgs
        return msgs


@dataclasses.dataclass
class _Entry:
    host: WorkerHost
    link: Link
    incarnation: int = 1
    alive: bool = True
    draining: bool = False


class Cluster:
    """A `ViewSource` over some of the module's hosts; tests kill, restart and add workers."""

    def __init__(self, hosts: dict[str, WorkerHost], *worker_ids: str):
        self.hosts = hosts
        self.entries = {wid: _Entry(hosts[wid], Link(hosts[wid])) for wid in worker_ids}

    async def workers(self) -> list[WorkerInfo]:
        return [WorkerInfo(wid, WorkerRole(e.host.spec.role), e.incarnation, e.alive, e.host.session,
                           e.host.conn.stats, e.incarnation - 1, e.link, draining=e.draining)
                for wid, e in self.entries.items()]

    def drain(self, wid: str) -> None:
        """As the controller does before it stops a worker (a rolling restart, SIGTERM)."""
        self.entries[wid].draining = True

    def link(self, wid: str) -> Link:
        return self.entries[wid].link

    def add(self, wid: str) -> None:
        self.entries[wid] = _Entry(self.hosts[wid], Link(self.hosts[wid]))

    def cut(self, wid: str) -> None:
        self.entries[wid].link.cut = True

    def mark_dead(self, wid: str) -> None:
        self.entries[wid].alive = False

    def restart(self, wid: str) -> None:
        """A new incarnation on the same host (the host's state must be at rest first)."""
        e = self.entries[wid]
        e.incarnation, e.alive, e.link, e.draining = e.incarnation + 1, True, Link(e.host), False


def serve(cluster: Cluster, tok, scenario, **kw):
    """Run `await scenario(dispatcher)` on a fresh event loop; the dispatcher is closed afterwards."""
    async def main():
        d = Dispatcher.build(cluster, DispatcherConfig(model_name="smollm2", max_model_len=2048,
                                                       **{"refresh_interval_s": 0.05, "collect_timeout_s": 0.05, **kw}),
                             tokenizer=tok)
        await d.start()
        try:
            return await scenario(d)
        finally:
            await d.close()
    return asyncio.run(main())


# ---- helpers ----------------------------------------------------------------------------------------


STREAM_TIMEOUT_S = 60.0  # no await in this file may hang the suite: pytest-timeout is not installed


async def collect(stream, timeout_s: float = STREAM_TIMEOUT_S) -> list:
    async def drain():
        return [chunk async for chunk in stream]
    return await asyncio.wait_for(drain(), timeout_s)


async def next_chunk(stream, timeout_s: float = STREAM_TIMEOUT_S):
    return await asyncio.wait_for(stream.__anext__(), timeout_s)


def tokens(chunks) -> list[int]:
    return [t for c in chunks for t in c.new_token_ids]


def assert_finished_cleanly(chunks) -> None:
    assert chunks, "the stream ended without a chunk"
    assert all(c.finish_reason is None for c in chunks[:-1]), "a chunk before the last one has a finish_reason"
    last = chunks[-1]
    assert last.finish_reason in ("stop", "length") and not last.error and last.error_kind is None, last


async def wait_at_rest(*hosts: WorkerHost, timeout_s: float = REST_TIMEOUT_S) -> None:
    """Every worker idle, no PRIVATE or IN_FLIGHT page, landing pool all free, no locked tree node,
    integrity OK. Async: the dispatcher must keep relaying (a landing returns on a relayed message)."""
    await settled(lambda: {h.worker_id: why for h in hosts if (why := why_not_at_rest(h.worker))}, timeout_s)
    for host in hosts:
        assert not host.crashed, host.crashed
        host.worker.check_integrity()
        cache = host.worker.engine.kvm.prefix_cache
        assert cache.evictable_pages() == cache.cached_pages(), f"{host.worker_id}: a tree node is still locked"


# ---- tests ------------------------------------------------------------------------------------------


def test_disaggregated_greedy_matches_colocated_engine(hosts, tok, reference):
    prompts = [chat(tok, i) for i in range(5)]
    expected = reference(prompts)
    page_bytes = hosts["decode-0"].worker.receiver.landing.layout.page_bytes
    cluster = Cluster(hosts, "prefill-0", "decode-0")

    async def scenario(d):
        streams = [d.generate(f"t1-{i}", pr, greedy(max_tokens=MAX_NEW)) for i, pr in enumerate(prompts)]
        results = await asyncio.gather(*map(collect, streams))
        assert not d.flights and d.num_requests() == (0, 0)
        await wait_at_rest(hosts["prefill-0"], hosts["decode-0"])
        return results

    results = serve(cluster, tok, scenario)
    assert [tokens(chunks) for chunks in results] == expected
    for chunks, prompt in zip(results, prompts):
        assert_finished_cleanly(chunks)
        last = chunks[-1]
        assert (last.prefill_worker, last.decode_worker) == ("prefill-0", "decode-0")
        assert last.kv_transfer_bytes == ceil_div(len(prompt), PAGE) * page_bytes  # the whole landing
        assert last.kv_transfer_s is not None and last.kv_transfer_s >= 0
        # its timeline: the phases it went through, each on its worker, adding up to its first token
        phases = last.timeline["phases"]
        assert [(ph["phase"], ph["worker"]) for ph in phases][:4] == [
            ("queued", "prefill-0"), ("reserving", "decode-0"), ("prefilling", "prefill-0"), ("streaming", "decode-0")]
        assert len(phases) == 4 and phases[-1]["s"] > 0 and all(ph["s"] >= 0 for ph in phases)  # streamed till now
        before_first = sum(ph["s"] for ph in phases[:3])
        assert abs(phases[0]["at_s"] + before_first - last.timeline["first_token_s"]) < 1e-3
        spans = last.timeline["worker_s"]
        assert {"prefill", "transfer", "transfer_after_compute", "prefill_queue", "prefill_compute"} <= set(spans)
        assert spans["prefill_queue"] + spans["prefill_compute"] == pytest.approx(spans["prefill"], abs=0.01)


def test_abort_mid_stream_and_mid_prefill_releases_everything(hosts, tok, long_prompt):
    prefill, decode = hosts["prefill-0"], hosts["decode-0"]
    cluster = Cluster(hosts, "prefill-0", "decode-0")

    async def scenario(d):
        # The client walks away after two chunks: closing the stream aborts it on the decode worker.
        stream = d.generate("t2-a", chat(tok, 1), greedy(max_tokens=LONG, ignore_eos=True))
        got = [await next_chunk(stream) for _ in range(2)]
        assert all(c.new_token_ids and c.finish_reason is None for c in got)
        await stream.aclose()
        assert not d.flights and d.num_requests() == (0, 0)
        # Without the abort the decode worker would run LONG tokens (~16 s here).
        await wait_at_rest(prefill, decode, timeout_s=3.0)

        # The gateway's order on a disconnect: abort first, then close the stream.
        stream = d.generate("t2-c", chat(tok, 2), greedy(max_tokens=LONG, ignore_eos=True))
        await next_chunk(stream), await next_chunk(stream)
        await d.abort("t2-c")
        assert not d.flights and d.num_requests() == (0, 0)
        await stream.aclose()
        await wait_at_rest(prefill, decode, timeout_s=3.0)

        # Aborted while its prompt is prefilling: the decode side gives up the landing, the
        # prefill side stops shipping, and the landing returns once the prefill side confirms.
        stream = d.generate("t2-b", long_prompt, greedy(max_tokens=LONG))
        await wait_for(lambda: (sh := prefill.worker.sender.shipments.get("t2-b.0")) is not None and sh.pages_sent > 0,
                       "the prefill worker to ship its first pages")
        assert d.flights["t2-b"].phase is Phase.PREFILLING
        # the landing is lent
        assert decode.worker.receiver.landing.pool.usage().in_flight == ceil_div(len(long_prompt), PAGE)
        await d.abort("t2-b")
        await d.abort("t2-b")  # idempotent
        await d.abort("never-started")
        assert not d.flights and d.num_requests() == (0, 0)
        await wait_at_rest(prefill, decode, timeout_s=3.0)
        await stream.aclose()
        assert d.lives["prefill-0"].pending_prefill_tokens == 0  # the routing load went with the transfer

    serve(cluster, tok, scenario)


def test_prefill_death_mid_transfer_reroutes_to_local_prefill(hosts, tok, reference, long_prompt):
    prefill, decode = hosts["prefill-0"], hosts["decode-0"]
    [expected] = reference([long_prompt])
    cluster = Cluster(hosts, "prefill-0", "decode-0")

    async def scenario(d):
        task = asyncio.create_task(collect(d.generate("t3", long_prompt, greedy(max_tokens=MAX_NEW))))
        await wait_for(lambda: (sh := prefill.worker.sender.shipments.get("t3.0")) is not None and sh.pages_sent > 0,
                       "the prefill worker to ship its first pages")
        assert decode.worker.receiver.landing.pool.usage().in_flight > 0  # the landing is being written
        cluster.cut("prefill-0")
        # The in-process host outlives its link; a dead process would compute nothing more.
        prefill.deliver([p.AbortTransfer("t3.0", "test: this worker is dead")])
        chunks = await asyncio.wait_for(task, 60)
        assert d.lives["prefill-0"].gone and not d.flights
        # Only the dispatcher's PeerDead could have returned the landing: the prefill side's
        # TransferAborted never got through the cut link.
        await wait_at_rest(decode)
        await wait_at_rest(prefill)

        # The controller restarts it: the new incarnation is adopted and serves disaggregated again.
        cluster.restart("prefill-0")
        await wait_for(lambda: not d.lives["prefill-0"].gone, "the new incarnation to be adopted")
        again = await collect(d.generate("t3-again", chat(tok, 0), greedy(max_tokens=2)))
        await wait_at_rest(prefill, decode)
        return chunks, again

    chunks, again = serve(cluster, tok, scenario)
    assert_finished_cleanly(chunks)
    assert tokens(chunks) == expected
    last = chunks[-1]
    assert (last.prefill_worker, last.decode_worker, last.kv_transfer_bytes) == ("", "decode-0", 0)
    # its timeline: routed twice (the second time to the decode worker, which computed the prompt itself)
    phases = [(ph["phase"], ph["worker"]) for ph in last.timeline["phases"]]
    assert phases[0] == ("queued", "prefill-0") and ("local", "decode-0") in phases and phases[-1][0] == "streaming"
    assert {"queue", "compute"} <= set(last.timeline["worker_s"]) and last.timeline["worker_s"]["compute"] > 0
    assert_finished_cleanly(again)
    assert again[-1].prefill_worker == "prefill-0"


SEEDED = dict(max_tokens=40, temperature=0.8, top_p=0.95, seed=77, ignore_eos=True)


def test_decode_death_mid_stream_resumes_on_another_decode_worker_token_identically(hosts, tok):
    """A seeded sampled stream whose decode worker dies after two chunks goes on on the other decode
    worker from the tokens already streamed: the stream is the undisturbed run's, no token repeated
    or missing, one uninterrupted stream."""
    prefill = hosts["prefill-0"]
    cluster = Cluster(hosts, "prefill-0", "decode-0", "decode-tiny")
    params = dataclasses.replace(greedy(), **SEEDED)

    async def scenario(d):
        undisturbed = await collect(d.generate("t4-ref", chat(tok, 2), params))
        stream = d.generate("t4", chat(tok, 2), params)
        got = [await next_chunk(stream) for _ in range(2)]
        victim = d.flights["t4"].decode.worker_id
        cluster.cut(victim)
        rest = await collect(stream, 30)
        assert not d.flights and d.num_requests() == (0, 0)
        assert d.migrations.counter.labels(outcome="resumed")._value.get() == 1
        survivor = hosts[({"decode-0", "decode-tiny"} - {victim}).pop()]
        await wait_at_rest(prefill, survivor)
        hosts[victim].deliver([p.Abort("t4.0")])  # the "dead" host still runs it
        await wait_at_rest(hosts[victim])
        return undisturbed, got + rest, victim, survivor.worker_id

    undisturbed, chunks, victim, survivor = serve(cluster, tok, scenario)
    assert_finished_cleanly(undisturbed)
    assert_finished_cleanly(chunks)
    assert tokens(chunks) == tokens(undisturbed) and len(tokens(chunks)) == SEEDED["max_tokens"]
    assert chunks[-1].decode_worker == survivor != victim


def test_a_stream_with_no_live_peer_waits_for_its_workers_restart_and_fails_past_the_timeout(hosts, tok):
    """The only decode worker dies mid-stream: the stream waits (MIGRATING, counted as waiting) and
    resumes, token-identically, on the worker's next incarnation; with no restart within
    `migration.timeout_s`, it ends with a clean 503-kind error naming why."""
    from router.migration import MigrationParams

    prefill, decode = hosts["prefill-0"], hosts["decode-0"]
    cluster = Cluster(hosts, "prefill-0", "decode-0")
    params = dataclasses.replace(greedy(), **SEEDED)

    async def scenario(d):
        undisturbed = await collect(d.generate("t4c-ref", chat(tok, 3), params))
        stream = d.generate("t4c", chat(tok, 3), params)
        got = [await next_chunk(stream) for _ in range(2)]
        cluster.cut("decode-0")
        await wait_for(lambda: d.flights["t4c"].phase is Phase.MIGRATING, "the stream to wait for a worker")
        assert d.num_requests() == (0, 1)
        decode.deliver([p.Abort("t4c.0")])  # the "dead" host still runs it
        await wait_at_rest(decode)
        cluster.restart("decode-0")
        rest = await collect(stream, 30)
        await wait_at_rest(prefill, decode)
        return undisturbed, got + rest

    undisturbed, chunks = serve(cluster, tok, scenario)
    assert_finished_cleanly(chunks)
    assert tokens(chunks) == tokens(undisturbed)

    cluster = Cluster(hosts, "prefill-0", "decode-0")

    async def no_restart(d):
        stream = d.generate("t4d", chat(tok, 3), params)
        got = [await next_chunk(stream)]
        cluster.cut("decode-0")
        rest = await collect(stream, 10)
        assert not d.flights
        decode.deliver([p.Abort("t4d.0")])
        await wait_at_rest(prefill, decode)
        return got + rest

    chunks = serve(cluster, tok, no_restart, migration=MigrationParams(timeout_s=0.5))
    last = chunks[-1]
    assert last.finish_reason == "abort" and last.error_kind is ErrorKind.UNAVAILABLE, last
    assert "decode-0" in last.error and "no worker could resume its stream within 0.5 s" in last.error


def test_a_draining_decode_worker_hands_its_streams_to_a_peer_token_identically(hosts, tok):
    """A decode worker marked draining mid-stream (a rolling restart, SIGTERM): the dispatcher
    releases the stream there (Abort: that worker comes to rest with no cut link) and resumes it on the
    other decode worker, the undisturbed run's tokens; a new request goes to the peer only."""
    prefill = hosts["prefill-0"]
    cluster = Cluster(hosts, "prefill-0", "decode-0", "decode-tiny")
    params = dataclasses.replace(greedy(), **SEEDED)

    async def scenario(d):
        undisturbed = await collect(d.generate("t4e-ref", chat(tok, 2), params))
        stream = d.generate("t4e", chat(tok, 2), params)
        got = [await next_chunk(stream) for _ in range(2)]
        victim = d.flights["t4e"].decode.worker_id
        survivor = ({"decode-0", "decode-tiny"} - {victim}).pop()
        cluster.drain(victim)
        rest = await collect(stream, 30)
        await wait_at_rest(hosts[victim])  # released by the dispatcher's Abort, while its link lives
        later = await collect(d.generate("t4e-new", chat(tok, 1), greedy(max_tokens=4)))
        await wait_at_rest(prefill, hosts[survivor], hosts[victim])
        assert d.migrations.counter.labels(outcome="resumed")._value.get() == 1
        return undisturbed, got + rest, survivor, later

    undisturbed, chunks, survivor, later = serve(cluster, tok, scenario)
    assert_finished_cleanly(chunks)
    assert tokens(chunks) == tokens(undisturbed) and len(tokens(chunks)) == SEEDED["max_tokens"]
    assert chunks[-1].decode_worker == survivor
    assert_finished_cleanly(later)
    assert later[-1].decode_worker == survivor


def test_the_only_decode_worker_draining_keeps_its_streams_and_holds_new_requests(hosts, tok, reference):
    """With no peer, a draining worker's streams run on there to their end; a new request meanwhile
    waits (counted as waiting, not refused) and is served by the worker's next incarnation."""
    prefill, decode = hosts["prefill-0"], hosts["decode-0"]
    cluster = Cluster(hosts, "prefill-0", "decode-0")
    params = dataclasses.replace(greedy(), **SEEDED)
    [expected] = reference([chat(tok, 1)], 4)

    async def scenario(d):
        undisturbed = await collect(d.generate("t4f-ref", chat(tok, 3), params))
        stream = d.generate("t4f", chat(tok, 3), params)
        got = [await next_chunk(stream)]
        cluster.drain("decode-0")
        await wait_for(lambda: d.lives["decode-0"].info.draining, "the dispatcher to see the drain")
        held = d.generate("t4f-new", chat(tok, 1), greedy(max_tokens=4))
        assert d.flights["t4f-new"].phase is Phase.MIGRATING and d.num_requests() == (1, 1)
        rest = await collect(stream, 30)  # on the draining worker, undisturbed
        await wait_at_rest(prefill, decode)
        cluster.restart("decode-0")
        answered = await collect(held, 30)
        await wait_at_rest(prefill, decode)
        assert d.migrations.counter.labels(outcome="resumed")._value.get() == 1  # the held one
        return undisturbed, got + rest, answered

    undisturbed, chunks, answered = serve(cluster, tok, scenario)
    assert_finished_cleanly(chunks)
    assert tokens(chunks) == tokens(undisturbed) and chunks[-1].decode_worker == "decode-0"
    assert_finished_cleanly(answered)
    assert tokens(answered) == expected


def test_decode_death_before_the_first_token_reroutes_to_another_decode_worker(hosts, tok, reference):
    prefill, decode, tiny = hosts["prefill-0"], hosts["decode-0"], hosts["decode-tiny"]
    prompt = chat(tok, 1)
    [expected] = reference([prompt])
    cluster = Cluster(hosts, "prefill-0", "decode-0")

    async def scenario(d):
        prefill.deliver([Stall(2.0)])  # the transfer cannot finish before decode-0 dies
        task = asyncio.create_task(collect(d.generate("t4b", prompt, greedy(max_tokens=MAX_NEW))))
        await wait_for(lambda: d.flights["t4b"].phase is Phase.PREFILLING, "the landing on decode-0")
        assert d.flights["t4b"].decode.worker_id == "decode-0"
        cluster.add("decode-tiny")
        await wait_for(lambda: "decode-tiny" in d.lives, "decode-tiny to join")
        cluster.cut("decode-0")
        chunks = await asyncio.wait_for(task, 30)
        await wait_at_rest(prefill, tiny)
        # decode-0 still holds the landing for a prefill worker that will never write it again.
        decode.deliver([p.PeerDead(d.lives["prefill-0"].peer_id)])
        await wait_at_rest(decode)
        return chunks

    chunks = serve(cluster, tok, scenario)
    assert_finished_cleanly(chunks)
    assert tokens(chunks) == expected
    assert (chunks[-1].prefill_worker, chunks[-1].decode_worker) == ("prefill-0", "decode-tiny")


def test_controller_views_bury_and_adopt_incarnations(hosts, tok):
    prefill, decode = hosts["prefill-0"], hosts["decode-0"]
    cluster = Cluster(hosts, "prefill-0", "decode-0")

    async def one(d, rid):
        chunks = await collect(d.generate(rid, chat(tok, 0), greedy(max_tokens=2)))
        assert_finished_cleanly(chunks)
        return chunks[-1].prefill_worker

    async def scenario(d):
        assert await one(d, "t9-a") == "prefill-0"
        cluster.mark_dead("prefill-0")  # the controller's heartbeat lost it; its link still works
        await wait_for(lambda: d.lives["prefill-0"].gone, "the dispatcher to bury prefill-0")
        assert {x["worker_id"]: x["alive"] for x in d.worker_details()} == {"decode-0": True, "prefill-0": False}
        assert await one(d, "t9-b") == ""  # the decode worker prefills it
        cluster.restart("prefill-0")
        await wait_for(lambda: not d.lives["prefill-0"].gone, "the new incarnation to be adopted")
        [x] = [x for x in d.worker_details() if x["worker_id"] == "prefill-0"]
        assert (x["incarnation"], x["restarts"], x["alive"]) == (2, 1, True)
        assert await one(d, "t9-c") == "prefill-0"
        await wait_at_rest(prefill, decode)

    serve(cluster, tok, scenario)


def test_refusals_queue_full_unavailable_rejected(hosts, tok):
    prefill, decode = hosts["prefill-0"], hosts["decode-0"]
    limit = decode.worker.engine.max_request_tokens()
    vocab = decode.worker.engine.arch.vocab_size

    async def disaggregated(d):
        a = d.generate("t5-a", chat(tok, 0), greedy(max_tokens=2))
        b = d.generate("t5-b", chat(tok, 1), greedy(max_tokens=2))
        with pytest.raises(BackendError) as full:
            d.generate("t5-c", chat(tok, 2), greedy(max_tokens=2))
        assert full.value.kind is ErrorKind.QUEUE_FULL and full.value.retry_after_s
        assert set(d.flights) == {"t5-a", "t5-b"}
        for done in await asyncio.gather(collect(a), collect(b)):
            assert_finished_cleanly(done)
        first = d.generate("t5-d", chat(tok, 0), greedy(max_tokens=LONG))
        with pytest.raises(BackendError) as dup:  # an id in flight is refused, not merged into it
            d.generate("t5-d", chat(tok, 0), greedy())
        assert dup.value.kind is ErrorKind.REJECTED
        await d.abort("t5-d")
        await first.aclose()
        # Never fits the decode worker's context / pool, or names tokens outside the vocabulary.
        refused = [await collect(d.generate("t5-long", [5] * limit, greedy(max_tokens=2))),
                   await collect(d.generate("t5-vocab", [1, vocab], greedy(max_tokens=2)))]
        await wait_at_rest(prefill, decode)
        return refused

    async def local(d):  # no prefill worker: the decode worker refuses it itself
        return [await collect(d.generate("t5-local-long", [5] * limit, greedy(max_tokens=2)))]

    async def no_decoder(d):
        with pytest.raises(BackendError) as unavailable:
            d.generate("t5-none", chat(tok, 0), greedy(max_tokens=2))
        assert unavailable.value.kind is ErrorKind.UNAVAILABLE and unavailable.value.retry_after_s
        assert not d.flights and d.num_requests() == (0, 0)

    refused = serve(Cluster(hosts, "prefill-0", "decode-0"), tok, disaggregated, max_pending=2)
    refused += serve(Cluster(hosts, "decode-0"), tok, local)
    dead = Cluster(hosts, "prefill-0", "decode-0")
    dead.mark_dead("decode-0")
    serve(dead, tok, no_decoder)
    serve(Cluster(hosts, "prefill-0"), tok, no_decoder)
    for chunks in refused:
        assert len(chunks) == 1, chunks
        [only] = chunks
        assert only.finish_reason == "abort" and only.new_token_ids == ()
        assert only.error_kind is ErrorKind.REJECTED and only.error


def test_a_full_landing_pool_makes_requests_wait_for_a_landing(hosts, tok, reference):
    prefill, tiny = hosts["prefill-0"], hosts["decode-tiny"]
    prompts = [chat(tok, i) for i in (1, 2, 3, 7)]
    need = [ceil_div(len(pr), PAGE) for pr in prompts]
    assert all(TINY_HOST_PAGES // 2 < n <= TINY_HOST_PAGES for n in need), need  # one landing at a time
    expected = reference(prompts)
    cluster = Cluster(hosts, "prefill-0", "decode-tiny")
    waiting_seen = []

    async def scenario(d):
        streams = [d.generate(f"t6-{i}", pr, greedy(max_tokens=MAX_NEW)) for i, pr in enumerate(prompts)]
        gather = asyncio.ensure_future(asyncio.gather(*map(collect, streams)))
        while not gather.done():  # collect() bounds it
            waiting_seen.append(d.num_requests()[1])
            await asyncio.sleep(0.01)
        await wait_at_rest(prefill, tiny)
        return gather.result()

    results = serve(cluster, tok, scenario)
    assert [tokens(chunks) for chunks in results] == expected
    for chunks in results:
        assert_finished_cleanly(chunks)
        assert (chunks[-1].prefill_worker, chunks[-1].decode_worker) == ("prefill-0", "decode-tiny")
    full = [m for m in cluster.link("decode-tiny").seen if isinstance(m, p.Reserved) and m.landing is None]
    assert full and all(not m.error for m in full), "the landing pool never filled: the retry path was not taken"
    assert max(waiting_seen) >= 1


def test_gauges_and_details_follow_the_requests(hosts, tok):
    prefill, decode = hosts["prefill-0"], hosts["decode-0"]
    cluster = Cluster(hosts, "prefill-0", "decode-0")

    def gauge(d, wid):
        return {g.worker_id: g for g in d.worker_gauges()}[wid]

    async def scenario(d):
        details = {x["worker_id"]: x for x in d.worker_details()}
        assert list(details) == ["decode-0", "prefill-0"]
        for wid, host in (("prefill-0", prefill), ("decode-0", decode)):
            x = details[wid]
            assert (x["role"], x["incarnation"], x["alive"], x["session"]) == (host.spec.role, 1, True, host.session)
            assert x["stats"] is None or x["stats"]["integrity_error"] == ""
        streams = [d.generate(f"t7-{i}", chat(tok, i), greedy(max_tokens=LONG, ignore_eos=True)) for i in range(2)]
        assert d.num_requests() == (0, 2)  # reserving: waiting
        for stream in streams:
            await next_chunk(stream)
        assert d.num_requests() == (2, 0)
        await wait_for(lambda: gauge(d, "decode-0").num_running == 2, "the decode worker's stats to show 2 running")
        g_dec, g_pre = gauge(d, "decode-0"), gauge(d, "prefill-0")
        assert (g_dec.role, g_dec.alive, g_pre.role, g_pre.alive) == ("decode", True, "prefill", True)
        assert 0 < g_dec.kv_usage <= 1 and g_dec.landing_kv_usage is not None and g_pre.landing_kv_usage is None
        assert g_dec.restarts == 0
        for stream in streams:
            await stream.aclose()
        assert d.num_requests() == (0, 0)
        await wait_for(lambda: gauge(d, "decode-0").num_running == 0, "the decode worker's stats to show 0 running")
        await wait_at_rest(prefill, decode)

    serve(cluster, tok, scenario)


def test_drain_and_close_end_open_streams_and_abort_them_on_the_workers(hosts, tok):
    prefill, decode = hosts["prefill-0"], hosts["decode-0"]
    cluster = Cluster(hosts, "prefill-0", "decode-0")

    async def scenario(d):
        stream = d.generate("t8-drain", chat(tok, 3), greedy(max_tokens=LONG, ignore_eos=True))
        await next_chunk(stream)
        assert d.abort_all() == 1
        rest = await collect(stream, 2)
        assert rest[-1].error_kind is ErrorKind.UNAVAILABLE and rest[-1].finish_reason == "abort"
        await wait_at_rest(prefill, decode, timeout_s=3.0)  # aborted there too, not left to run LONG tokens

        stream = d.generate("t8-close", chat(tok, 3), greedy(max_tokens=LONG, ignore_eos=True))
        await next_chunk(stream)
        task = asyncio.create_task(collect(stream))
        await asyncio.sleep(0.1)
        await d.close()
        rest = await asyncio.wait_for(task, 2)  # the consumer is told, not left waiting forever
        assert rest[-1].error_kind is ErrorKind.UNAVAILABLE and rest[-1].finish_reason == "abort"
        assert not d.flights

    serve(cluster, tok, scenario)
    asyncio.run(wait_at_rest(prefill, decode, timeout_s=3.0))


def test_overload_is_refused_at_arrival_and_queued_requests_keep_their_transfer_deadlines(hosts, tok, reference):
    """24 requests at once, far more than the prefill worker serves within the transfer deadlines
    (5 s): the excess is refused at arrival (429 kind, Retry-After), the admitted ones wait in the
    dispatcher, not on a landing, so no deadline fires and none is re-prefilled; every admitted one
    gets the colocated engine's greedy tokens, and the workers end at rest."""
    prefill, decode = hosts["prefill-short"], hosts["decode-short"]
    rng = random.Random(10)  # distinct random prompts: no prefix-cache hit shortens a prefill
    prompts = [[rng.randrange(100, 20000) for _ in range(rng.randrange(33, 49))] for _ in range(24)]
    window_tokens = 2 * ENGINE.chunk_size
    assert all(len(pr) > window_tokens // 4 for pr in prompts)  # at most 3 fit the window at once
    expected = reference(prompts)
    cluster = Cluster(hosts, "prefill-short", "decode-short")
    landings = []  # landings reserved on the decode worker and not yet written, sampled

    def num_landings() -> int:
        while True:
            try:  # the worker's thread may change the dict while we copy it
                return sum(ib.phase is InboundPhase.LANDING for ib in list(decode.worker.receiver.inbound.values()))
            except RuntimeError:
                continue

    async def scenario(d):
        # The first completion is cold, and a lone prefill's time is no sample: then two at once.
        assert_finished_cleanly(await collect(d.generate("t10-cold", chat(tok, 0), greedy(max_tokens=2))))
        warm = [d.generate(f"t10-warm{i}", chat(tok, i), greedy(max_tokens=2)) for i in range(2)]
        for stream in warm:
            assert_finished_cleanly(await collect(stream))
        rate = d.lives["prefill-short"].lane.rate.tokens_per_s
        assert rate, "the warm-up measured no prefill rate"
        # A budget whose plan holds ~400 prompt tokens at the measured rate (whatever this machine's
        # speed): ~10 of the 24 prompts (~960 tokens) are admitted, the 4th on queue, the rest refused.
        d.config = dataclasses.replace(d.config, admission=dataclasses.replace(
            d.config.admission, max_queue_delay_s=400 / rate / PLAN_SHARE))
        streams, refused = {}, []
        start_s = time.monotonic()
        for i, prompt in enumerate(prompts):
            try:
                streams[i] = d.generate(f"t10-{i}", prompt, greedy(max_tokens=MAX_NEW))
            except BackendError as exc:
                refused.append(exc)
        arrival_s = time.monotonic() - start_s
        num_queued = sum(f.phase is Phase.QUEUED for f in d.flights.values())  # admitted, waiting in the router
        gather = asyncio.ensure_future(asyncio.gather(*map(collect, streams.values())))
        while not gather.done():  # collect() bounds it
            landings.append(num_landings())
            await asyncio.sleep(0.01)
        await wait_at_rest(prefill, decode)
        return dict(zip(streams, gather.result())), refused, arrival_s, num_queued, d.reroutes._value.get()

    results, refused, arrival_s, num_queued, reroutes = serve(
        cluster, tok, scenario, admission=AdmissionParams(prefill_window_tokens=window_tokens))
    assert refused, "nothing was refused: the flood was admitted whole"
    assert results and num_queued >= 1, (f"{len(results)} admitted, {num_queued} of them queued in the router; "
                                         f"refused: {refused[0]}")
    assert arrival_s < 1.0, f"refusing took {arrival_s:.2f}s: it must be decided at arrival"
    for exc in refused:
        assert exc.kind is ErrorKind.QUEUE_FULL and exc.retry_after_s > 0 and "capacity" in exc.message
    for i, chunks in results.items():
        assert_finished_cleanly(chunks)
        assert tokens(chunks) == expected[i], f"request {i}"
    assert reroutes == 0, "a request was re-prefilled: a transfer deadline fired while it waited"
    assert 0 < max(landings) <= 3, f"{max(landings)} landings at once: landings reserved while queued"
