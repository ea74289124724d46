"""Dispatcher paths that need a worker to misbehave on cue: scripted links instead of real workers."""

from __future__ import annotations

import asyncio

import pytest

from common import protocol as p
from common.config import SamplingParams
from common.protocol import WorkerRole
from router.admission import AdmissionParams
from router.backend import BackendError, ErrorKind
from router.dispatcher import Dispatcher, DispatcherConfig, Phase, WorkerInfo


class ScriptedLink:
    """A `WorkerLink` that answers each delivered message with `reply(msg)` (a list of messages)."""

    def __init__(self, reply) -> None:
        self.reply, self.received = reply, []
        self._outbox: asyncio.Queue = asyncio.Queue()

    async def send(self, msgs: list) -> None:
        for msg in msgs:
            self.received.append(msg)
            for answer in self.reply(msg):
                self._outbox.put_nowait(answer)

    async def collect(self, timeout_s: float) -> list:
        # Not asyncio.wait_for: on 3.11 it can swallow a cancel that races the item's arrival,
        # and the dispatcher's collector would then never stop.
        getter = asyncio.ensure_future(self._outbox.get())
        try:
            done, _ = await asyncio.wait({getter}, timeout=timeout_s)
        finally:
            getter.cancel()
        if not done:
            return []
        out = [getter.result()]
        while not self._outbox.empty():
            out.append(self._outbox.get_nowait())
        return out


class StaticViews:
    def __init__(self, links: dict) -> None:
        self.links = links

    async def workers(self) -> list[WorkerInfo]:
        return [WorkerInfo(wid, role, 1, True, f"session-{wid}", None, 0, link)
                for wid, (role, link) in self.links.items()]


def test_a_request_that_never_gets_a_landing_fails_after_the_landing_timeout():
    """Host tiers that stay full must not hold a request forever: after `landing_timeout_s` it ends
    with a 503-kind error, and it was retried in between."""
    decode = ScriptedLink(lambda msg: [p.Reserved(msg.request_id, None, "")] if isinstance(msg, p.Reserve) else [])
    prefill = ScriptedLink(lambda msg: [])

    async def run():
        views = StaticViews({"prefill-0": (WorkerRole.PREFILL, prefill), "decode-0": (WorkerRole.DECODE, decode)})
        d = Dispatcher.build(views, DispatcherConfig(model_name="m", max_model_len=1024, collect_timeout_s=0.05,
                                                     reserve_retry_s=0.02, landing_timeout_s=0.4))
        await d.start()
        try:
            async def consume():
                return [c async for c in d.generate("r0", [5, 6, 7], SamplingParams(max_tokens=4))]

            chunks = await asyncio.wait_for(consume(), 10)  # without the timeout it would wait forever
            return chunks, dict(d.flights)
        finally:
            await d.close()

    chunks, flights = asyncio.run(run())
    assert len(chunks) == 1 and chunks[0].error_kind is ErrorKind.UNAVAILABLE and "room to land" in chunks[0].error
    reserves = [m for m in decode.received if isinstance(m, p.Reserve)]
    assert len(reserves) >= 3 and {m.request_id for m in reserves} == {"r0.0"}
    assert not any(isinstance(m, p.Prefill) for m in prefill.received)  # nothing was ever handed over
    assert flights == {}


def test_a_request_refused_a_landing_is_not_overtaken_by_younger_ones():
    """The decode worker has no room for r0 three times; r1 and r2 arrive after the first and would fit.
    The lane is held for r0 until it has its landing: no younger Reserve goes out between its
    tries, and the prefill worker gets r0 first (before, younger requests took the room r0 waited
    for, again and again)."""
    refusals = {"r0.0": 3}

    def reply(msg) -> list:
        if isinstance(msg, p.Reserve) and refusals.get(msg.request_id):
            refusals[msg.request_id] -= 1
            return [p.Reserved(msg.request_id, None, "")]
        return decode_reply(msg)

    async def scenario(d, decode, prefill):
        streams = [d.generate("r0", list(range(3, 33)), SamplingParams(max_tokens=4))]
        await until(lambda: len(sent(decode, p.Reserve)) >= 2, "r0 refused once and trying again")
        streams += [d.generate(f"r{i}", list(range(3, 13)), SamplingParams(max_tokens=4)) for i in (1, 2)]
        for wire in ("r0.0", "r1.0", "r2.0"):
            await prefilled(prefill, wire)
            prefill.emit(p.KVComplete(wire, FIRST_TOKEN))
        results = [await drain(s) for s in streams]
        return results, sent(decode, p.Reserve), sent(prefill, p.Prefill)

    results, reserves, prefills = run_scenario(scenario, AdmissionParams(prefill_window_tokens=1000),
                                               decode=ScriptedLink(reply))
    assert reserves == ["r0.0"] * 4 + ["r1.0", "r2.0"] and prefills == ["r0.0", "r1.0", "r2.0"]
    assert all(chunks[-1].finish_reason == "length" and not chunks[-1].error for chunks in results)


# ---- admission: queued in the dispatcher, refused at arrival ------------------------------------------

LAYOUT = p.KVLayout(num_layers=1, page_size=16, num_kv_heads=1, head_dim=4, dtype="float32", element_bytes=4)
FIRST_TOKEN = 7


def landing_for(msg: p.Reserve) -> p.Landing:
    num_pages = -(-len(msg.prompt_token_ids) // LAYOUT.page_size)
    return p.Landing(msg.request_id, "session-decode-0", tuple(range(1, num_pages + 1)), (0,), (0,), LAYOUT, 60.0)


def decode_reply(msg) -> list:
    """A decode worker with room for every landing that finishes each request on its first token."""
    if isinstance(msg, p.Reserve):
        return [p.Reserved(msg.request_id, landing_for(msg), "")]
    if isinstance(msg, p.KVComplete):
        return [p.TokenOutput(msg.request_id, (msg.first_token,), p.FinishReason.LENGTH, "")]
    if isinstance(msg, p.Generate):
        return [p.TokenOutput(msg.request_id, (FIRST_TOKEN,), p.FinishReason.LENGTH, "")]
    if isinstance(msg, p.PeerDead):  # what a decode worker says for each landing the dead peer held
        return [p.TokenOutput(rid, (), p.FinishReason.ABORT, "transfer peer_dead", failure=p.Failure.TRANSFER)
                for rid in LANDED]
    return []


LANDED: list[str] = []  # wire ids whose Prefill was sent, for the PeerDead reply


class PrefillLink(ScriptedLink):
    """Takes every Prefill and says nothing until the test completes it; can die (collect raises)."""

    def __init__(self) -> None:
        super().__init__(lambda msg: [])
        self.dead = False

    def emit(self, msg) -> None:
        self._outbox.put_nowait(msg)

    async def collect(self, timeout_s: float) -> list:
        if self.dead:
            raise ConnectionError("prefill-0 is unreachable")
        return await super().collect(timeout_s)


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


async def until(cond, what: str, timeout_s: float = 5.0) -> None:
    async def poll():
        while not cond():
            await asyncio.sleep(0.005)
    try:
        await asyncio.wait_for(poll(), timeout_s)
    except asyncio.TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


def run_scenario(scenario, admission: AdmissionParams, clock=None, decode=None):
    """`await scenario(d, decode_link, prefill_link)` over one scripted decode and one prefill worker."""
    decode = decode or ScriptedLink(decode_reply)
    prefill = PrefillLink()
    LANDED.clear()

    async def main():
        views = StaticViews({"prefill-0": (WorkerRole.PREFILL, prefill), "decode-0": (WorkerRole.DECODE, decode)})
        d = Dispatcher.build(views, DispatcherConfig(model_name="m", max_model_len=4096, collect_timeout_s=0.02,
                                                     admission=admission), clock=clock or FakeClock())
        await d.start()
        try:
            return await asyncio.wait_for(scenario(d, decode, prefill), 20)
        finally:
            await d.close()

    return asyncio.run(main())


def sent(link, kind) -> list[str]:
    return [m.request_id for m in link.received if isinstance(m, kind)]


async def prefilled(prefill: PrefillLink, wire_id: str) -> None:
    await until(lambda: wire_id in sent(prefill, p.Prefill), f"the Prefill of {wire_id}")
    LANDED.append(wire_id)


async def drain(stream) -> list:
    return [c async for c in stream]


def test_requests_wait_in_the_dispatcher_until_the_prefill_worker_has_room_and_overflow_is_refused_at_once():
    """The landing is reserved only when the prefill worker has room (so queue time never runs a
    transfer deadline), and a request beyond the queue bound gets a 429-kind error at arrival."""
    prompt = list(range(3, 33))  # 30 tokens: one fits the 40-token window at a time

    async def scenario(d, decode, prefill):
        streams = [d.generate(f"r{i}", prompt, SamplingParams(max_tokens=4)) for i in range(3)]
        with pytest.raises(BackendError) as full:
            d.generate("r3", prompt, SamplingParams(max_tokens=4))
        assert full.value.kind is ErrorKind.QUEUE_FULL and full.value.retry_after_s >= 1.0
        assert "2 requests already queued" in full.value.message and "r3" not in d.flights
        assert [f.phase for f in d.flights.values()] == [Phase.RESERVING, Phase.QUEUED, Phase.QUEUED]
        assert d.num_requests() == (0, 3) and d.lives["prefill-0"].pending_prefill_tokens == 90
        for i in range(3):
            await prefilled(prefill, f"r{i}.0")
            assert sent(decode, p.Reserve) == [f"r{j}.0" for j in range(i + 1)]  # the next waits for room
            prefill.emit(p.KVComplete(f"r{i}.0", FIRST_TOKEN))
        results = [await drain(s) for s in streams]
        assert not d.flights and d.lives["prefill-0"].pending_prefill_tokens == 0
        return results, d.reroutes._value.get(), d.refusals.labels(role="prefill")._value.get()

    results, reroutes, refused = run_scenario(scenario,
                                              AdmissionParams(prefill_window_tokens=40, max_queued_requests=2))
    assert [[c.new_token_ids for c in chunks] for chunks in results] == [[(FIRST_TOKEN,)]] * 3
    assert all(chunks[-1].finish_reason == "length" and not chunks[-1].error for chunks in results)
    assert (reroutes, refused) == (0, 1)


def test_admission_refuses_by_the_predicted_first_token_at_the_measured_rate():
    clock = FakeClock()
    prompt = list(range(3, 103))  # 100 tokens

    async def scenario(d, decode, prefill):
        async def admitted(rid: str):
            stream = d.generate(rid, prompt, SamplingParams(max_tokens=4))
            await prefilled(prefill, f"{rid}.0")
            return stream

        async def complete(rid: str, stream) -> None:
            prefill.emit(p.KVComplete(f"{rid}.0", FIRST_TOKEN))
            await drain(stream)

        await complete("c0", await admitted("c0"))  # the cold first prefill, 5 s: no rate sample
        clock.now_s = 5.0
        alone = await admitted("x0")
        clock.now_s = 6.0
        await complete("x0", alone)  # alone at the worker: no sample either
        pair = [await admitted("w0a"), await admitted("w0b")]  # two at once: a loaded period
        clock.now_s = 7.0  # 100 tokens in 1 s of service
        await complete("w0a", pair[0])
        clock.now_s = 8.0
        await complete("w0b", pair[1])
        streams = [await admitted("w1"), await admitted("w2")]  # w2: 1 s behind w1, 1 s its own: 2 <= 2.25 s
        with pytest.raises(BackendError) as full:
            d.generate("w3", prompt, SamplingParams(max_tokens=4))
        assert full.value.kind is ErrorKind.QUEUE_FULL and full.value.retry_after_s == pytest.approx(0.75)
        assert "predicted prefill done in 3.00s, past the 2.25s admission plans for" in full.value.message
        clock.now_s = 8.5  # w1 and w2 have had 0.5 s of service
        with pytest.raises(BackendError) as full:
            d.generate("w4", prompt, SamplingParams(max_tokens=4))
        assert full.value.retry_after_s == pytest.approx(0.25)
        clock.now_s = 9.0
        await complete("w1", streams[0])
        streams.append(await admitted("w5"))  # 1 s left of w2: admitted again
        for rid, stream in (("w2", streams[1]), ("w5", streams[2])):
            clock.now_s += 1.0
            await complete(rid, stream)
        assert not d.flights
        return d.lives["prefill-0"].lane.rate.tokens_per_s

    rate = run_scenario(scenario, AdmissionParams(max_queue_delay_s=3.75), clock)  # plans for 2.25 s
    assert rate == pytest.approx(100.0)


def test_a_full_decode_worker_refuses_at_arrival():
    async def scenario(d, decode, prefill):
        streams = [d.generate(f"x{i}", [5, 6, 7], SamplingParams(max_tokens=4)) for i in range(2)]
        with pytest.raises(BackendError) as full:
            d.generate("x2", [5, 6, 7], SamplingParams(max_tokens=4))
        assert full.value.kind is ErrorKind.QUEUE_FULL and "router.max_requests_per_worker" in full.value.message
        assert d.refusals.labels(role="decode")._value.get() == 1
        for i, stream in enumerate(streams):
            await prefilled(prefill, f"x{i}.0")
            prefill.emit(p.KVComplete(f"x{i}.0", FIRST_TOKEN))
            await drain(stream)
        d.generate("x3", [5, 6, 7], SamplingParams(max_tokens=4))  # room again
        await d.abort("x3")

    run_scenario(scenario, AdmissionParams(max_requests_per_worker=2))


def test_queued_requests_of_a_dead_prefill_worker_are_routed_afresh_not_re_prefilled():
    """Only the request its prefill worker actually held counts as a re-route; the queued ones
    were never handed over, so they keep their attempt number and their retry budget."""
    async def scenario(d, decode, prefill):
        streams = [d.generate(f"q{i}", list(range(3, 33)), SamplingParams(max_tokens=4)) for i in range(3)]
        await prefilled(prefill, "q0.0")
        prefill.dead = True
        results = [await drain(s) for s in streams]
        assert d.lives["prefill-0"].gone and not d.flights
        return results, d.reroutes._value.get()

    results, reroutes = run_scenario(scenario, AdmissionParams(prefill_window_tokens=40),
                                     decode=ScriptedLink(decode_reply))
    assert all(chunks[-1].finish_reason == "length" and chunks[-1].new_token_ids == (FIRST_TOKEN,)
               for chunks in results)
    assert reroutes == 1  # q0 alone


def test_a_decode_worker_whose_first_tokens_come_later_than_the_budget_admits_fewer_down_to_half():
    """Once first tokens come later than the TTFT budget (smoothed), their decode worker's limit is
    cut below what it holds, never below half its maximum, and the next arrival beyond it is refused."""
    clock = FakeClock()
    prompt = [5, 6, 7]

    async def scenario(d, decode, prefill):
        async def complete(rid: str, stream) -> None:
            await prefilled(prefill, f"{rid}.0")
            prefill.emit(p.KVComplete(f"{rid}.0", FIRST_TOKEN))
            await drain(stream)

        alone = d.generate("a0", prompt, SamplingParams(max_tokens=4))
        clock.now_s = 1.0
        await complete("a0", alone)  # TTFT 1 s: within the budget
        limit = d.lives["decode-0"].limit
        streams = {rid: d.generate(rid, prompt, SamplingParams(max_tokens=4)) for rid in
                   ["z", *(f"b{i}" for i in range(15))]}
        with pytest.raises(BackendError) as full:
            d.generate("b15", prompt, SamplingParams(max_tokens=4))
        assert "router.max_requests_per_worker" in full.value.message
        clock.now_s = 40.0  # 39 s to the first token
        for i in range(6):  # smoothed TTFT 8.6, 14.7, 19.5, 23.4, 26.5, 29.0 s: within 30 s, hold
            await complete(f"b{i}", streams.pop(f"b{i}"))
            assert (limit.limit, limit.epoch) == (16.0, 0), i
        await complete("b6", streams.pop("b6"))  # smoothed 31 s: cut from the 10 it holds, to the floor 8
        assert (limit.limit, limit.epoch) == (8.0, 1)
        await complete("b7", streams.pop("b7"))  # admitted under the old limit: no second cut
        assert (limit.limit, limit.epoch) == (8.0, 1)
        with pytest.raises(BackendError) as full:  # 8 in flight (z, b8..b14), the limit is 8
            d.generate("c0", prompt, SamplingParams(max_tokens=4))
        assert "cut while first tokens came later than router.max_queue_delay_s" in full.value.message
        await complete("b8", streams.pop("b8"))
        d.generate("c1", prompt, SamplingParams(max_tokens=4))  # room again
        await d.abort("c1")
        for rid in list(streams):
            await complete(rid, streams.pop(rid))
        return d.refusals.labels(role="decode")._value.get()

    assert run_scenario(scenario, AdmissionParams(max_queue_delay_s=30.0, max_requests_per_worker=16), clock) == 2
