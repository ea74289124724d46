"""Dispatcher paths that need a worker to misbehave on cue: scripted links instead of real workers."""

from __future__ import annotations

import asyncio

from cluster import protocol as p
from cluster.config import SamplingParams
from router.backend import ErrorKind
from router.dispatcher import Dispatcher, WorkerInfo
from router.policy import WorkerRole


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
        try:
            out = [await asyncio.wait_for(self._outbox.get(), timeout_s)]
        except asyncio.TimeoutError:
            return []
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
        d = Dispatcher(views, tokenizer=None, model_name="m", max_model_len=1024, collect_timeout_s=0.05,
                       reserve_retry_s=0.02, landing_timeout_s=0.4)
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
