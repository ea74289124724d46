"""The dispatcher: the gateway's backend over a set of workers (docs/design.md §2, §8).

It owns every in-flight request between the gateway and the workers: picks a route with the pure
policy, asks the decode worker for a landing, hands the prompt to the prefill worker, relays the
prefill <-> decode messages, streams tokens back. It never touches KV: each worker releases its own;
on failure it tells the survivors (`PeerDead`, `Abort`). Workers: `router.workers`; a request's
phases: `router.flights`. Its collaborators own their state, and it applies what they answer: the
route (`router.picker`), the transfer phase (reserve, hand-off, relay: `router.transfer_phase`), the
token relay's server (`router.relay_endpoint`); its knobs and the one place that wires them:
`router.dispatcher_config` (`DispatcherConfig`, `DispatcherParts.build`).

A transfer failure, or the death of a worker, before any token reached the client re-routes the
request (at most `max_transfer_retries` times); after that a dead or draining worker's stream resumes
on another (`router.migration`), or gets a clean error. A new request that finds no decoding worker
while one restarts waits for it. A session's turns go to the worker holding its history (`router.sessions`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

from common import protocol as p
from common.config import SamplingParams
from router.backend import BackendError, ErrorKind, GenerationChunk, WorkerGauge
from router.dispatcher_config import DispatcherConfig, DispatcherParts
from router.flights import WAITING, Flight, Phase, failure_outcome, observe_first_token, reroutes_counter, token_chunk
from router.migration import seeded
from router.sessions import SessionTurn
from router.transfer_phase import TRANSFER_MESSAGES, Landing
from router.workers import LiveWorker, ViewSource, WorkerInfo, WorkerLink, relay_metrics

__all__ = ["Dispatcher", "DispatcherConfig", "Phase", "ViewSource", "WorkerInfo", "WorkerLink"]

log = logging.getLogger("tandem.dispatcher")


class Dispatcher:
    """Implements `router.backend.Backend`. Runs on one asyncio loop; call `start` on it first.

    Owns the flights in flight (by request id; the routed ones also by wire id) and the live workers;
    `parts` own the rest. `config` may be replaced whole (a test tunes admission so): `parts` keep theirs."""

    def __init__(self, source: ViewSource, config: DispatcherConfig, parts: DispatcherParts, tokenizer=None):
        """`Dispatcher.build` makes one with the `parts` made from `config`."""
        self.source, self.config, self.tokenizer = source, config, tokenizer
        self.model_name, self.max_model_len = config.model_name, config.max_model_len
        self.clock, self.state, self.picker, self.transfers = parts.clock, parts.state, parts.picker, parts.transfers
        self.answers, self.sessions, self.migrations = parts.answers, parts.sessions, parts.migrations
        self.token_relay = parts.token_relay
        self.lives: dict[str, LiveWorker[Flight]] = {}
        self.flights: dict[str, Flight] = {}
        self._by_wire: dict[str, Flight] = {}
        self._tasks: list[asyncio.Task] = []
        self.relay, self.polls = relay_metrics()
        self.reroutes, self.refusals = reroutes_counter(), self.picker.refusals
        self.extra_collectors = [self.relay, self.polls, self.reroutes, self.refusals, self.answers.counter,
                                 self.migrations.counter]

    @classmethod
    def build(cls, source: ViewSource, config: DispatcherConfig, *, tokenizer=None,
              clock: Callable[[], float] = time.monotonic) -> Dispatcher:
        """A dispatcher over the workers `source` shows, with the collaborators `DispatcherParts.build` wires."""
        return cls(source, config, DispatcherParts.build(config, clock), tokenizer)

    # ---- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.token_relay.start(self.lives, self._on_message, self.polls)
        await self.refresh()
        self._tasks.append(asyncio.create_task(self._refresh_forever(), name="dispatcher-refresh"))

    async def close(self) -> None:
        """Abort everything still in flight (their streams end with an error), then stop every task."""
        self.abort_all()
        await asyncio.gather(*(live.flush() for live in self.lives.values()))
        tasks = self._tasks + [t for live in self.lives.values() for t in live.tasks]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.token_relay.close()

    def abort_all(self) -> int:
        """End every stream in flight with an error, released on its workers; returns how many."""
        left = list(self.flights.values())
        for flight in left:  # not `abort` alone: a consumer would wait for a last chunk
            self._shut_down(flight)
        return len(left)

    async def refresh(self) -> None:
        """Pull the controller's views: adopt new incarnations, bury dead ones, update stats."""
        for info in await self.source.workers():
            live = self.lives.get(info.worker_id)
            if live is not None and live.info.incarnation == info.incarnation:
                live.info = info
                if not info.alive:
                    self._worker_gone(live, "the controller declared it dead")
                elif info.draining:
                    self._drain(live)
                continue
            if info.alive:  # first, so requests of the old incarnation can be re-routed to the new one
                self._adopt(info)
            if live is not None:
                self._worker_gone(live, f"replaced by incarnation {info.incarnation}")
        self._resume_parked()

    # ---- Backend -----------------------------------------------------------------------------------
    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 session_id: str = "", follow: str = "") -> AsyncIterator[GenerationChunk]:
        """Route the request now (raising `BackendError` when it cannot start) and return its stream.
        `follow` (`Backend.generate`): to that request's decode worker while it is in flight there."""
        if request_id in self.flights:
            raise BackendError(ErrorKind.REJECTED, f"request id {request_id!r} is already in flight")
        if len(self.flights) >= self.config.max_pending:
            raise BackendError(ErrorKind.QUEUE_FULL, f"{len(self.flights)} requests in flight; retry later",
                               retry_after_s=1.0)
        params = seeded(params)
        if session_id:
            flight: Flight = SessionTurn(request_id, list(prompt_token_ids), params, submitted_at=self.clock(),
                                         session_id=session_id)
            self._route_to(flight, self.sessions.worker_of(session_id, self.lives.values()))  # raises first
        else:
            flight = Flight(request_id, list(prompt_token_ids), params, submitted_at=self.clock())
            leader = self.flights.get(follow)
            if leader is not None and leader.decode is not None and leader.decode.view().alive:
                self._route_to(flight, leader.decode)
            else:  # nothing to follow (it finished, or its worker is gone): the policy routes it
                try:
                    self._route(flight, admit=True)  # raises BackendError before anything is registered
                except BackendError as exc:  # no worker decodes now: held while one restarts, else raised
                    self.migrations.hold(flight, exc, self.lives.values(), self.clock())
        self.flights[request_id] = flight
        return self._stream(flight)

    async def open_session(self, capacity_tokens: int, idle_timeout_s: float) -> str:
        return await self.sessions.open(self.lives.values(), capacity_tokens, idle_timeout_s,
                                       self.config.session_open_timeout_s)

    async def close_session(self, session_id: str) -> bool:
        return self.sessions.close(session_id)

    async def abort(self, request_id: str) -> None:
        if (flight := self.flights.pop(request_id, None)) is not None:
            self._abort_on_worker(flight)
            self._end(flight)

    def num_requests(self) -> tuple[int, int]:
        waiting = sum(f.phase in WAITING for f in self.flights.values())
        return len(self.flights) - waiting, waiting

    def worker_gauges(self) -> list[WorkerGauge]:
        return [live.gauge() for live in sorted(self.lives.values(), key=lambda lv: lv.worker_id)]

    def worker_details(self) -> list[dict]:  # each worker's identity and last heartbeat stats (JSON-able)
        return [live.details() for live in sorted(self.lives.values(), key=lambda lv: lv.worker_id)]

    # ---- routing -----------------------------------------------------------------------------------
    def _route(self, flight: Flight, *, admit: bool) -> None:
        """Pick its workers (`RoutePicker.pick`, raising `BackendError` before anything is registered) and
        queue it on its prefill worker's lane (or send it to its decode worker to prefill locally).
        `admit`: a new arrival, refused (429) when no worker can take it promptly; one admitted before
        (re-routed, back from a full landing pool) goes to the front instead."""
        flight.decode, flight.prefill = self.picker.pick(flight, self.lives.values(),
                                                         self.config.admission if admit else None)
        flight.decode.num_active += 1
        if admit:  # its first token will be a sample for its decode worker's limit
            flight.limit_epoch = flight.decode.limit.epoch
        self._by_wire[flight.wire_id] = flight
        if flight.prefill is None:
            flight.move(Phase.LOCAL)
            flight.decode.send(p.Generate(flight.wire_id, tuple(flight.prompt), flight.params))
            return
        flight.move(Phase.QUEUED)
        flight.prefill.lane.enqueue(flight, len(flight.prompt), front=not admit)
        self.transfers.pump(flight.prefill)

    def _route_to(self, flight: Flight, decode: LiveWorker) -> None:
        """Send `flight` to `decode` to prefill there itself, unadmitted: a sibling choice following choice 0
        (its prompt cached there), or a session's turn to the worker holding its history."""
        if not isinstance(flight, SessionTurn):
            self.state.record_cached(decode.view(), flight.prompt)
            flight.limit_epoch = decode.limit.epoch
        flight.decode = decode
        decode.num_active += 1
        flight.move(Phase.LOCAL)
        self._by_wire[flight.wire_id] = flight
        decode.send(p.Generate(flight.wire_id, tuple(flight.prompt), flight.params, getattr(flight, "session_id", "")))

    def _failed(self, flight: Flight, failure: p.Failure, why: str, died: bool = False) -> None:
        """Its worker failed it (or `died`, a session's history with it): re-routed when `failure_outcome`
        allows and a route exists; else, if it died, it waits to resume; else it ends with that error."""
        kind = failure_outcome(failure, tokens_sent=flight.tokens_sent, attempt=flight.attempt,
                               max_retries=self.config.max_transfer_retries,
                               session=isinstance(flight, SessionTurn) and not died)
        if kind is None and self._reroute(flight, why):
            return
        if died:
            return self._park_or_fail(flight, why)
        self._finish_error(flight, kind or ErrorKind.UNAVAILABLE, why)

    def _reroute(self, flight: Flight, why: str) -> bool:
        """Try the request again on a fresh route; False when no worker can take it."""
        self._unroute(flight)
        flight.attempt += 1
        log.warning("re-routing %s (attempt %d): %s", flight.request_id, flight.attempt, why)
        self.reroutes.inc()
        try:
            self._route(flight, admit=False)
        except BackendError:
            return False
        return True

    def _unroute(self, flight: Flight) -> None:
        """Undo `_route`'s bookkeeping (the transfer, if any, ends on its own messages)."""
        self._by_wire.pop(flight.wire_id, None)
        flight.limit_epoch = None  # a later route's TTFT is no admission sample
        if flight.prefill is not None:
            flight.prefill.lane.discard(flight)
        if flight.decode is not None:
            flight.decode.num_active -= 1
            flight.decode = None

    # ---- messages from workers ---------------------------------------------------------------------
    def _on_message(self, live: LiveWorker, msg) -> None:
        if isinstance(msg, p.TokenOutput):
            self._on_tokens(live, msg)
        elif isinstance(msg, p.Reserved):
            self._on_reserved(msg)
        elif isinstance(msg, TRANSFER_MESSAGES):
            self._relay_transfer(msg)
        elif isinstance(msg, p.SessionOpened):
            self.sessions.on_opened(live, msg)
        elif isinstance(msg, p.WorkerCrashed):
            self._worker_gone(live, f"crashed:\n{msg.error}")
        else:
            log.warning("unexpected message from %s: %r", live.worker_id, msg)

    def _on_tokens(self, live: LiveWorker, msg: p.TokenOutput) -> None:
        flight = self._by_wire.get(msg.request_id)
        if flight is None or flight.decode is not live or flight.phase is Phase.DONE:
            return
        if msg.emitted_unix_s:
            self.relay.observe(max(0.0, time.time() - msg.emitted_unix_s))
        if msg.error:
            self._failed(flight, msg.failure or p.Failure.TRANSFER, msg.error)
            return
        if flight.tokens_sent == 0:
            observe_first_token(flight, self.clock() - flight.submitted_at, self.config.admission)
            if flight.prefill is None:  # its decode worker prefilled it
                self.state.record_prefilled(flight.prompt)
        flight.move(Phase.STREAMING)
        flight.output += msg.new_token_ids
        if msg.finish_reason is None:
            flight.queue.put_nowait(token_chunk(msg))
            return
        flight.queue.put_nowait(flight.last_chunk(msg, live.worker_id))
        if msg.finish_reason is not p.FinishReason.ABORT:
            self.answers.finished(flight, live)
        self._end(flight)

    # ---- the transfer phase's answers -------------------------------------------------------------
    def _on_reserved(self, msg: p.Reserved) -> None:
        if (flight := self._by_wire.get(msg.request_id)) is None:  # the transfer phase does all there is to do
            self.transfers.on_reserved(msg, None)
        elif (landing := self.transfers.on_reserved(msg, flight)) is Landing.REJECTED:
            self._finish_error(flight, ErrorKind.REJECTED, msg.error)
        elif landing is Landing.REFUSED:  # routed afresh after the pause (the lane is held for it meanwhile)
            self._unroute(flight)
            asyncio.get_running_loop().call_later(self.config.reserve_retry_s, self._retry_reserve, flight)

    def _retry_reserve(self, flight: Flight) -> None:
        """A refused reservation's pause is over: route it afresh, or fail it past the landing timeout."""
        held, timeout_s = flight.prefill, self.config.landing_timeout_s  # the lane it holds, if it still does
        try:
            if flight.phase is not Phase.BACKOFF or self.flights.get(flight.request_id) is not flight:
                return
            if flight.landing_wait_s(self.clock()) > timeout_s:  # landing pools stay full
                self._finish_error(flight, ErrorKind.UNAVAILABLE,
                                   f"no decode worker had room to land the prompt within {timeout_s}s")
                return
            try:
                self._route(flight, admit=False)
            except BackendError as exc:
                self._finish_error(flight, exc.kind, exc.message)
        finally:
            if held is not None:
                self.transfers.pump(held)  # its hold is over: the lane goes on (a no-op if `_route` pumped it)

    def _relay_transfer(self, msg) -> None:
        """Pass it on; a delivered prompt is noted cached on its prefill worker (if still routed)."""
        if self.transfers.relay(msg) and (flight := self._by_wire.get(msg.request_id)) is not None:
            self.state.record_prefilled(flight.prompt)

    # ---- endings -----------------------------------------------------------------------------------
    def _abort_on_worker(self, flight: Flight) -> None:
        """Tell the decode worker holding it (if any) to release it; the prefill side follows."""
        if flight.phase in (Phase.RESERVING, Phase.PREFILLING, Phase.LOCAL, Phase.STREAMING):
            flight.routed_decode().send(p.Abort(flight.wire_id))

    def _shut_down(self, flight: Flight) -> None:
        """Shutdown: release it on the workers, then end its stream with an error (in this order: once
        ended, `abort` finds nothing to tell the decode worker, and it would run on to its stop rules)."""
        self._abort_on_worker(flight)
        self._finish_error(flight, ErrorKind.UNAVAILABLE, "the server is shutting down")

    def _finish_error(self, flight: Flight, kind: ErrorKind, error: str) -> None:
        if flight.phase is not Phase.DONE:
            flight.queue.put_nowait(GenerationChunk((), "abort", error=error, error_kind=kind,
                                                    timeline=flight.timeline({})))
            self._end(flight)

    def _end(self, flight: Flight) -> None:
        """The request is over for the dispatcher (the workers release their own KV)."""
        flight.move(Phase.DONE)
        self._unroute(flight)
        self.flights.pop(flight.request_id, None)

    async def _stream(self, flight: Flight) -> AsyncIterator[GenerationChunk]:
        try:
            while True:
                chunk = await flight.queue.get()
                yield chunk
                if chunk.finish_reason is not None:
                    return
        finally:  # the consumer went away early (client disconnect): release it everywhere
            if flight.phase is not Phase.DONE:
                await self.abort(flight.request_id)

    # ---- workers -----------------------------------------------------------------------------------
    def _adopt(self, info: WorkerInfo) -> None:
        live = LiveWorker.admitting(info, self.config.admission)
        self.lives[info.worker_id] = live
        live.start(self._on_message, self._worker_gone, self.config.collect_timeout_s, self.polls)
        self.token_relay.greet(live)  # its first message, when it relays
        log.info("worker %s (%s, incarnation %d) joined", info.worker_id, info.role.value, info.incarnation)

    def _worker_gone(self, live: LiveWorker[Flight], why: str) -> None:
        """Fail or re-route what it held, tell the survivors, forget its prefix tree."""
        if live.gone:
            return
        live.gone = True
        log.error("worker %s (incarnation %d) is gone: %s", live.worker_id, live.info.incarnation, why)
        live.stop()
        self.state.forget_worker(live.worker_id)
        self.sessions.worker_gone(live, why)
        notice, roles = live.death_notice()
        for lv in self.lives.values():
            if not lv.gone and lv.info.role in roles:
                lv.send(notice)
        # Queued ones first, so that a window freed below is never handed to a request bound for `live`.
        queued = [f for f in self.flights.values() if f.decode is live and f.phase is Phase.QUEUED]
        self._route_afresh(live.lane.drain() + queued)
        self.transfers.gone_with(live)
        for flight in [f for f in self.flights.values() if f.decode is live]:
            self._failed(flight, p.Failure.TRANSFER, f"worker {live.worker_id} died: {why}", died=True)
        self._resume_parked()

    def _route_afresh(self, queued: list[Flight]) -> None:
        for flight in queued:  # never handed to a worker: routed afresh, not a re-route
            self._unroute(flight)
            try:
                self._route(flight, admit=False)
            except BackendError as exc:
                self._park_or_fail(flight, exc.message, exc.kind)

    def _drain(self, live: LiveWorker[Flight]) -> None:
        """`live` stops soon (`WorkerInfo.draining`): its queue is routed afresh, its streams moved away."""
        self._route_afresh(live.lane.drain())
        for flight in self.migrations.leaving(live, self.flights.values(), self.lives.values()):
            self._abort_on_worker(flight)
            self._park_or_fail(flight, f"worker {live.worker_id} is draining")
        self._resume_parked()

    def _park_or_fail(self, flight: Flight, why: str, kind: ErrorKind = ErrorKind.UNAVAILABLE) -> None:
        """Its worker died and no route takes it now: it waits to resume on one (`router.migration`)."""
        if not self.migrations.wants(flight):
            return self._finish_error(flight, kind, why)
        self._unroute(flight)
        self.migrations.park(flight, self.clock(), why.splitlines()[0])

    def _resume_parked(self) -> None:
        """Streams whose worker died resume on one that decodes (or end once out of time)."""
        ready, expired = self.migrations.take(self.lives.values(), self.clock())
        for park in expired:
            self._finish_error(park.flight, ErrorKind.UNAVAILABLE, park.error(self.migrations.params))
        for flight, worker in ready:
            worker.send(self.migrations.resume(flight, worker))  # queued: no answer before the next line
            self._by_wire[flight.wire_id] = flight

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.refresh_interval_s)
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception:  # keep serving with stale views; log.exception says so
                log.exception("refreshing worker views failed")
