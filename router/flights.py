"""A request as the dispatcher tracks it (`Flight`, its `Phase`), and the record a landing
reservation leaves behind (`Transfer`). State only; `router.dispatcher` moves them.

One request, disaggregated (wire id = `<request_id>.<attempt>`):

    arrival --admission (router.admission): refused at once, 429--> (never registered)
       v
    QUEUED --prefill window has room--> RESERVING --Reserved(landing)--> PREFILLING --first token--> STREAMING -> done
    (the dispatcher's queue:             | landing None: BACKOFF, then QUEUED again at the front
     nothing held on any worker)         |   (failed after `landing_timeout_s` without a landing)
                                         | error: rejected (400)
    local prefill (no prefill worker):  LOCAL --tokens--> STREAMING -> done

A failed transfer or a dead worker routes it again from any phase before STREAMING
(`failure_outcome` decides); after that, or with no route to take it, a dead worker's request
waits to resume (MIGRATING -> LOCAL on another worker, after the tokens it streamed:
`router.migration`). `Flight.move` checks every move against `_MOVES`.

The landing is reserved only when the prefill worker has room for the prompt (`PrefillLane`), so a
transfer's deadlines never count time the request spent queued, and no request is re-prefilled
because it waited.
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field

from common import protocol as p
from common.config import SamplingParams
from router.admission import AdmissionParams
from router.backend import ErrorKind, GenerationChunk
from router.timeline import describe
from router.workers import LiveWorker


class Phase(enum.Enum):
    QUEUED = "queued"  # admitted, in its prefill worker's lane queue: nothing held on any worker yet
    RESERVING = "reserving"
    BACKOFF = "backoff"  # the decode worker's landing pool was full: queued again after a pause
    PREFILLING = "prefilling"
    LOCAL = "local"  # the decode worker prefills it itself
    STREAMING = "streaming"  # tokens are flowing
    MIGRATING = "migrating"  # its worker died mid-stream: waiting for one to resume on (`router.migration`)
    DONE = "done"


WAITING = frozenset({Phase.QUEUED, Phase.RESERVING, Phase.BACKOFF, Phase.MIGRATING})
"""The phases of a request no worker computes for yet (the gauge of waiting requests)."""
_ROUTES = {Phase.QUEUED, Phase.LOCAL}  # where a route (a first one, or a re-route) puts a request
_MOVES: dict[Phase, frozenset[Phase]] = {
    Phase.QUEUED: frozenset({Phase.RESERVING, *_ROUTES, Phase.DONE}),  # re-queued when its worker died
    Phase.RESERVING: frozenset({Phase.PREFILLING, Phase.BACKOFF, *_ROUTES, Phase.DONE}),
    Phase.BACKOFF: frozenset({*_ROUTES, Phase.DONE}),
    Phase.PREFILLING: frozenset({Phase.STREAMING, *_ROUTES, Phase.DONE}),
    Phase.LOCAL: frozenset({Phase.STREAMING, *_ROUTES, Phase.DONE}),
    Phase.STREAMING: frozenset({Phase.STREAMING, Phase.DONE}),  # a token reached the client: no re-route
    Phase.MIGRATING: frozenset({Phase.LOCAL, Phase.DONE}),  # resumed on a worker that prefills it locally
    Phase.DONE: frozenset(),
}
for _phase in set(Phase) - {Phase.MIGRATING, Phase.DONE}:  # a dead worker's request waits from any phase
    _MOVES[_phase] |= {Phase.MIGRATING}
"""The moves `Flight.move` allows: the diagram above, plus a re-route from any phase before STREAMING
and a wait to resume (MIGRATING) from any phase."""


def _worker_in(phase: Phase, flight: Flight) -> str:
    """The worker a request entering `phase` is on ("" where none computes for it)."""
    live = flight.prefill if phase in (Phase.QUEUED, Phase.PREFILLING) else \
        flight.decode if phase in (Phase.RESERVING, Phase.LOCAL, Phase.STREAMING) else None
    return "" if live is None else live.worker_id


CORRUPT_RETRIES = 3
"""Re-routes a request whose landed KV failed its checksum gets beyond `max_transfer_retries`."""


class PhaseError(RuntimeError):
    """A move the table does not allow: a bug in the dispatcher."""


@dataclass(eq=False)
class Flight:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    phase: Phase = Phase.QUEUED
    attempt: int = 0
    migrations: int = 0  # times its stream resumed on another worker
    prefill: LiveWorker[Flight] | None = None
    decode: LiveWorker[Flight] | None = None
    output: list[int] = field(default_factory=list)  # token ids streamed so far
    landing_bytes: int = 0
    submitted_at: float = 0.0  # dispatcher clock
    reserve_started_at: float | None = None  # first Reserve sent (the landing timeout counts from there)
    limit_epoch: int | None = None  # its decode worker's `DecodeLimit.epoch` at admission (None: no sample)
    arrived: float = field(default_factory=time.monotonic)
    events: list[tuple[str, float, str]] = field(default_factory=list)
    """Its timeline: (phase entered, `time.monotonic()`, the worker it entered it on) per move."""

    def move(self, to: Phase) -> None:
        if to not in _MOVES[self.phase]:
            raise PhaseError(f"request {self.request_id}: {self.phase.value} -> {to.value} is not a move")
        if to is not self.phase or not self.events:
            self.events.append((to.value, time.monotonic(), _worker_in(to, self)))
        self.phase = to

    def timeline(self, worker_timings: dict[str, float]) -> dict:
        """Where its time went (`router.timeline.describe`), from arrival until now."""
        return describe(self.arrived, self.events, worker_timings, time.monotonic())

    def routed_decode(self) -> LiveWorker[Flight]:
        """Its decode worker, for a flight that has one (routed: QUEUED on to STREAMING)."""
        assert self.decode is not None, \
            f"request {self.request_id} ({self.phase.value}) has no decode worker: used after it was unrouted?"
        return self.decode

    def landing_wait_s(self, now: float) -> float:
        """Seconds since its first `Reserve` (the landing timeout counts from there)."""
        assert self.reserve_started_at is not None, \
            f"request {self.request_id} ({self.phase.value}) never sent a Reserve: backing off before RESERVING?"
        return now - self.reserve_started_at

    @property
    def tokens_sent(self) -> int:
        return len(self.output)

    @property
    def wire_id(self) -> str:
        return f"{self.request_id}.{self.attempt}"

    def last_chunk(self, msg: p.TokenOutput, decode_worker: str) -> GenerationChunk:
        """The chunk that ends it, from its decode worker's finishing output."""
        assert msg.finish_reason is not None, f"request {self.request_id}: a last chunk from an unfinished output"
        timings = dict(msg.timings)
        transfer_s = (timings["transfer_done"] - timings["first_write"]
                      if "transfer_done" in timings and "first_write" in timings else None)
        return GenerationChunk(
            tuple(msg.new_token_ids), msg.finish_reason.value, kv_transfer_s=transfer_s,
            cached_tokens=min(msg.cached_tokens, len(self.prompt)),  # a resumed run's also counts its output
            kv_transfer_bytes=self.landing_bytes if self.prefill else 0,
            prefill_worker=self.prefill.worker_id if self.prefill else "", decode_worker=decode_worker,
            logprobs=msg.logprobs, prompt_logprobs=msg.prompt_logprobs, cached_tiers=msg.cached_tiers, timings=timings,
            timeline=self.timeline(timings))


@dataclass(eq=False)
class Transfer:
    """A reservation's two ends, kept until the prefill side's terminal message has been relayed
    (or an end died), even when the request itself is already over: the decode worker frees the
    landing only on that message."""

    prefill: LiveWorker[Flight]
    decode: LiveWorker[Flight]
    prompt_len: int  # tokens it holds in the prefill worker's window
    prefill_sent: bool = False  # the prompt is at the prefill worker (its service time counts)


def failure_outcome(failure: p.Failure, *, tokens_sent: int, attempt: int, max_retries: int,
                    session: bool) -> ErrorKind | None:
    """What a request its worker failed (or lost) gets: None, a re-route; else the error kind its
    client gets. Only a failed transfer is worth another route, and only while no token reached the
    client, retries are left, and it is no session's turn (whose history lives on that worker)."""
    if failure is p.Failure.REJECTED:
        return ErrorKind.REJECTED
    if failure is p.Failure.BUSY:
        return ErrorKind.QUEUE_FULL
    if failure is p.Failure.INTERNAL:  # a fault of its own: a retry would meet it again
        return ErrorKind.INTERNAL
    if failure is p.Failure.CORRUPT and not tokens_sent and attempt < max_retries + CORRUPT_RETRIES:
        return None  # damaged bytes are no sign that the next route fails: never served, computed again
    if tokens_sent or attempt >= max_retries or session:
        return ErrorKind.UNAVAILABLE
    return None


def token_chunk(msg: p.TokenOutput) -> GenerationChunk:
    """The chunk of a worker's output that does not end its request."""
    return GenerationChunk(tuple(msg.new_token_ids), logprobs=msg.logprobs, prompt_logprobs=msg.prompt_logprobs)


def observe_first_token(flight: Flight, ttft_s: float, admission: AdmissionParams) -> None:
    """Admission learns from each first token whether its decode worker's limit kept the promise."""
    if flight.limit_epoch is not None:
        decode = flight.routed_decode()
        decode.limit.observe(ttft_s, admission.max_queue_delay_s, flight.limit_epoch, decode.num_active)


def reroutes_counter():
    """Requests re-routed on their way to a worker (their refusals at arrival: `router.picker`)."""
    from prometheus_client import Counter

    return Counter("tandem:request_reroutes_total",
                   "Requests re-routed after a transfer failure or a worker death, before any token",
                   registry=None)
