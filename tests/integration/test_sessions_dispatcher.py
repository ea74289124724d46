"""Streaming sessions through the real dispatcher over in-process workers (one prefill, two decode;
`WorkerHost` threads with a `LocalTransport` each, the tiny Llama in place of a loaded model): a
session lives on one decode worker, its turns all go there and hit its pinned history, each turn's
greedy tokens equal a no-cache engine's for the whole conversation, closing releases the pin, and a
session outlives its worker's death (its turn resumed, the session opened again elsewhere)."""

from __future__ import annotations

import functools

import pytest

from cluster.worker_host.thread import WorkerHost
from common import protocol as p
from common.config import EngineConfig
from router.backend import BackendError, ErrorKind
from tests import dispatch_harness
from tests.debug_worker import Stall, build_debug_worker
from tests.dispatch_harness import RecordingLink, all_at_rest, start_hosts, stop_hosts, wait_for
from tests.helpers import greedy, make_engine, make_prompts

PAGE_SIZE = 4
DECODES = ("decode-0", "decode-1")


@pytest.fixture
def hosts():
    """prefill-0, decode-0, decode-1: 256 usable pages of 4 tokens each (a 512-token session budget)."""
    config = EngineConfig(page_size=PAGE_SIZE, num_pages=257, chunk_size=16, debug_kv=True)
    workers = (("prefill-0", "prefill", 0), ("decode-0", "decode", 128), ("decode-1", "decode", 128))
    built = start_hosts(config, workers, build_debug_worker)
    yield built
    stop_hosts(built)


@pytest.fixture(scope="module")
def reference():
    engine = make_engine(page_size=PAGE_SIZE, num_pages=257, enable_prefix_cache=False)

    def run(prompt: list[int], max_tokens: int) -> list[int]:
        [req] = engine.generate([prompt], greedy(max_tokens=max_tokens))
        return req.output_token_ids
    yield run
    engine.check_integrity()


serve = functools.partial(dispatch_harness.serve, link=RecordingLink)


async def run(d, rid, prompt, max_tokens, session_id=""):
    """(token ids, last chunk) of one greedy request."""
    return await dispatch_harness.run(d, rid, prompt, greedy(max_tokens=max_tokens), session_id=session_id)


def sessions_of(host: WorkerHost) -> dict:
    return host.worker.engine.sessions.sessions


def holder(hosts, session_id: str) -> str:
    [wid] = [wid for wid in DECODES if session_id in sessions_of(hosts[wid])]
    return wid


def aligned_history(num_tokens: int) -> int:
    """What a worker pins of a history: its page-aligned committed KV (the last token has none)."""
    return (num_tokens - 1) // PAGE_SIZE * PAGE_SIZE


def test_turns_stay_on_the_session_worker_and_match_the_reference(hosts, reference):
    new_tokens = make_prompts(3, min_len=5, max_len=23, seed=3)  # unaligned lengths
    plain_prompt = make_prompts(1, min_len=40, max_len=40, seed=4)[0]

    async def scenario(d, views):
        a = await d.open_session(300, 60.0)
        b = await d.open_session(200, 60.0)  # fewest sessions: the other decode worker
        where = holder(hosts, a)
        assert {where, holder(hosts, b)} == set(DECODES)
        turns, history = [], []
        for i, new in enumerate(new_tokens):
            prompt = history + new
            tokens, last = await run(d, f"a{i}", prompt, 6, session_id=a)
            turns.append((prompt, tokens, last, aligned_history(len(history)) if history else 0))
            history = prompt + tokens
            assert holder(hosts, a) == where and sessions_of(hosts[where])[a].pinned_tokens == aligned_history(
                len(history)), f"turn {i}: the pin did not follow the history"
        plain = await run(d, "plain", plain_prompt, 6)  # a plain request still goes disaggregated
        with pytest.raises(BackendError) as unknown:
            d.generate("x", new_tokens[0], greedy(max_tokens=2), session_id="sess-never-opened")
        assert await d.close_session(a) and await d.close_session(b) and not await d.close_session(a)
        await wait_for(lambda: not any(sessions_of(hosts[w]) or hosts[w].worker.engine.kvm.prefix_pins
                                       for w in DECODES), "closing to release the pins")
        await all_at_rest(hosts)
        assert not d.flights and all(lv.num_active == 0 for lv in d.lives.values())
        return where, turns, plain, unknown.value

    where, turns, plain, unknown = serve(hosts, scenario)
    for i, (prompt, tokens, last, pinned_before) in enumerate(turns):
        assert tokens == reference(prompt, 6), f"turn {i}"
        assert last.decode_worker == where and last.prefill_worker == "" and not last.error
        assert last.cached_tokens == pinned_before and (i == 0 or pinned_before > 0), f"turn {i}: cached"
    assert plain[0] == reference(plain_prompt, 6) and plain[1].prefill_worker == "prefill-0"
    assert unknown.kind is ErrorKind.NOT_FOUND and "not open" in unknown.message


def test_a_session_outlives_its_worker(hosts, reference):
    """The session's worker dies while a turn streams: the turn resumes on the other decode worker
    (a plain request there, its tokens the reference's), and the session's next turn opens it again
    there, where that history is now cached, and goes on with the reference's tokens. An orphan
    left idle past its idle timeout is lost, with why."""
    import asyncio

    prompt = make_prompts(1, min_len=13, max_len=13, seed=5)[0]

    async def scenario(d, views):
        a = await d.open_session(300, 60.0)
        where = holder(hosts, a)
        first, _ = await run(d, "t0", prompt, 3, session_id=a)
        turn1 = prompt + first + [7, 8]
        stream = d.generate("t1", turn1, greedy(max_tokens=24), session_id=a)
        got = [await asyncio.wait_for(stream.__anext__(), 30)]
        views.dead.add(where)
        got += [chunk async for chunk in stream]
        second = [t for c in got for t in c.new_token_ids]
        turn2 = turn1 + second + [9]
        third, last = await run(d, "t2", turn2, 4, session_id=a)
        moved = ({*DECODES} - {where}).pop()
        assert a in sessions_of(hosts[moved])
        hosts[where].deliver([p.CloseSession(a), p.Abort("t1.0")])  # the in-process host outlives its "death"
        b = await d.open_session(100, 0.05)
        views.dead.add(moved)  # b is on the survivor: now every decode worker is dead
        await wait_for(lambda: all(lv.gone for wid, lv in d.lives.items() if wid in DECODES), "both buried")
        await asyncio.sleep(0.1)  # past b's idle timeout
        with pytest.raises(BackendError) as lost:
            d.generate("t3", prompt, greedy(max_tokens=2), session_id=b)
        for wid in DECODES:
            hosts[wid].deliver([p.CloseSession(a), p.CloseSession(b)])
        await wait_for(lambda: not any(sessions_of(hosts[w]) for w in DECODES), "every session to close")
        await all_at_rest(hosts)
        return where, moved, (turn1, second), (turn2, third, last), got[-1], lost.value, d.sessions.reopened

    where, moved, (turn1, second), (turn2, third, last), resumed, lost, reopened = serve(hosts, scenario)
    assert moved != where and reopened == 1
    assert not resumed.error and second == reference(turn1, 24) and resumed.decode_worker == moved
    assert third == reference(turn2, 4) and last.decode_worker == moved and not last.error
    assert last.cached_tokens > len(turn1)  # the resumed turn's history was cached where it moved
    assert lost.kind is ErrorKind.NOT_FOUND and "died" in lost.message


def test_an_orphan_with_no_room_to_open_again_gets_429_and_stays_an_orphan(hosts, reference):
    """The session's worker dies; the survivor's session budget is full: the next turn is refused
    with QUEUE_FULL (429, retry later), not lost; once room is made the retried turn opens it there."""
    prompt = make_prompts(1, min_len=13, max_len=13, seed=6)[0]

    async def scenario(d, views):
        a = await d.open_session(300, 60.0)
        where = holder(hosts, a)
        survivor = ({*DECODES} - {where}).pop()
        hosts[where].deliver([p.CloseSession(a)])  # the in-process host outlives its "death"
        views.dead.add(where)
        await wait_for(lambda: d.lives[where].gone, "the holder buried")
        filler = [await d.open_session(500, 60.0)]  # the survivor's budget (512 tokens) is now full
        assert holder(hosts, filler[0]) == survivor
        _, full = await run(d, "t0", prompt, 3, session_id=a)
        await d.close_session(filler[0])
        await wait_for(lambda: not sessions_of(hosts[survivor]), "room made")
        out, last = await run(d, "t1", prompt, 3, session_id=a)
        assert holder(hosts, a) == survivor
        hosts[survivor].deliver([p.CloseSession(a)])
        await wait_for(lambda: not sessions_of(hosts[survivor]), "every session to close")
        await all_at_rest(hosts)
        return full, out, last

    full, out, last = serve(hosts, scenario)
    assert full.error_kind is ErrorKind.QUEUE_FULL and "budget full" in full.error, full
    assert out == reference(prompt, 3) and not last.error


def test_open_failures_map_to_their_kinds(hosts):
    async def scenario(d, views):
        held = [await d.open_session(300, 60.0), await d.open_session(300, 60.0)]  # one per decode worker
        with pytest.raises(BackendError) as full:
            await d.open_session(300, 60.0)  # 600 of a 512-token budget
        with pytest.raises(BackendError) as too_big:
            await d.open_session(10**6, 60.0)
        for session_id in held:
            await d.close_session(session_id)
        for wid in DECODES:  # no answer in time; the answer that comes later is closed
            hosts[wid].deliver([Stall(0.5)])
        with pytest.raises(BackendError) as slow:
            await d.open_session(50, 60.0)
        late = views.links["decode-0"].sent[-1]  # ties go to the first worker by name
        assert isinstance(late, p.OpenSession) and late.capacity_tokens == 50, late
        await wait_for(lambda: p.CloseSession(late.session_id) in views.links["decode-0"].sent,
                       "the late open to be closed")
        await wait_for(lambda: not any(sessions_of(hosts[w]) for w in DECODES), "the late session to close")
        await all_at_rest(hosts)
        return full.value, too_big.value, slow.value

    full, too_big, slow = serve(hosts, scenario, session_open_timeout_s=0.2)
    assert full.kind is ErrorKind.QUEUE_FULL and "budget full" in full.message
    assert too_big.kind is ErrorKind.REJECTED and "exceeds" in too_big.message
    assert slow.kind is ErrorKind.UNAVAILABLE and "did not answer" in slow.message
