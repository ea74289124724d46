"""The dispatcher: the gateway's backend over a set of workers (DESIGN §2 steps 2-8).

It owns every in-flight request between the gateway and the workers: picks a route with the pure
policy, asks the decode worker for a landing, hands the prompt to the prefill worker, relays the
prefill <-> decode messages, and streams tokens back. It never touches KV: each worker releases its
own, and the dispatcher's job on failure is to tell the survivors (`PeerDead`, `Abort`).

Workers are reached through `WorkerLink`s (a Ray actor handle in a cluster, an in-process
`WorkerHost` in tests) and described by the controller's views (`ViewSource`). Per worker there is
one sender task (messages leave in order, batched) and one collector task (long-poll: every message
a worker produced since the last poll arrives in one call).

One request, disaggregated (wire id = `<request_id>.<attempt>`):

    arrival --admission (router.admission): refused at once, 429--> (never registered)
       v
    QUEUED --prefill window has room--> RESERVING --Reserved(landing)--> PREFILLING --first token--> STREAMING -> done
    (the dispatcher's queue:             | landing None: BACKOFF, then QUEUED again at the front
     nothing held on any worker)         |   (failed after `landing_timeout_s` without a landing)
                                         | error: rejected (400)
    local prefill (no prefill worker):  LOCAL --tokens--> STREAMING -> done

The landing is reserved only when the prefill worker has room for the prompt (`PrefillLane`), so a
transfer's deadlines never count time the request spent queued, and no request is re-prefilled
because it waited.

A transfer failure, or the death of a worker, before any token reached the client re-routes the
request (at most `max_transfer_retries` times); after that the client gets a clean error.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from prometheus_client import Counter

from cluster import protocol as p
from cluster.config import SamplingParams
from router.admission import (AdmissionParams, DecodeLimit, Overloaded, PrefillLane, UnloadedTtft, admissible,
                              ttft_aim_s)
from router.backend import BackendError, ErrorKind, GenerationChunk, WorkerGauge
from router.policy import NoWorkerAvailable, Policy, PolicyParams, RequestView, RouterState, choose
from cluster.protocol import WorkerRole
from router.workers import LiveWorker, ViewSource, WorkerInfo, WorkerLink, relay_metrics

__all__ = ["Dispatcher", "Phase", "ViewSource", "WorkerInfo", "WorkerLink"]

log = logging.getLogger("tandem.dispatcher")


class Phase(enum.Enum):
    QUEUED = "queued"  # admitted, in its prefill worker's lane queue: nothing held on any worker yet
    RESERVING = "reserving"
    BACKOFF = "backoff"  # the decode worker's host tier was full: queued again after a pause
    PREFILLING = "prefilling"
    LOCAL = "local"  # the decode worker prefills it itself
    STREAMING = "streaming"  # tokens are flowing
    DONE = "done"


@dataclass(eq=False)
class _Flight:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    phase: Phase = Phase.QUEUED
    attempt: int = 0
    prefill: LiveWorker | None = None
    decode: LiveWorker | None = None
    tokens_sent: int = 0
    landing_bytes: int = 0
    submitted_at: float = 0.0  # dispatcher clock
    reserve_started_at: float | None = None  # first Reserve sent (the landing timeout counts from there)
    found_idle: bool = False  # admitted with nothing else in flight: its TTFT is the unloaded figure
    limit_epoch: int | None = None  # its decode worker's `DecodeLimit.epoch` at admission (None: no sample)

    @property
    def wire_id(self) -> str:
        return f"{self.request_id}.{self.attempt}"


@dataclass(eq=False)
class _Transfer:
    """A reservation's two ends, kept until the prefill side's terminal message has been relayed
    (or an end died), even when the request itself is already over: the decode worker frees the
    landing only on that message."""

    prefill: LiveWorker
    decode: LiveWorker
    prompt_len: int  # tokens it holds in the prefill worker's window
    prefill_sent: bool = False  # the prompt is at the prefill worker (its service time counts)


class Dispatcher:
    """Implements `router.backend.Backend`. Runs on one asyncio loop; call `start` on it first."""

    def __init__(self, source: ViewSource, *, tokenizer, model_name: str, max_model_len: int,
                 policy: Policy = Policy.CACHE_AWARE, policy_params: PolicyParams = PolicyParams(),
                 max_pending: int = 256, max_transfer_retries: int = 1, refresh_interval_s: float = 0.5,
                 collect_timeout_s: float = 0.5, reserve_retry_s: float = 0.05, landing_timeout_s: float = 30.0,
                 admission: AdmissionParams = AdmissionParams(), clock: Callable[[], float] = time.monotonic):
        self.source, self.tokenizer = source, tokenizer
        self.model_name, self.max_model_len = model_name, max_model_len
        self.policy, self.policy_params = policy, policy_params
        self.state = RouterState(policy_params.max_tree_tokens)
        self.max_pending, self.max_transfer_retries = max_pending, max_transfer_retries
        self.refresh_interval_s, self.collect_timeout_s = refresh_interval_s, collect_timeout_s
        self.reserve_retry_s, self.landing_timeout_s = reserve_retry_s, landing_timeout_s
        self.admission, self.clock = admission, clock
        self.unloaded_ttft = UnloadedTtft(admission.rate_smoothing)
        self.lives: dict[str, LiveWorker] = {}
        self.flights: dict[str, _Flight] = {}
        self._by_wire: dict[str, _Flight] = {}
        self._transfers: dict[str, _Transfer] = {}
        self._tasks: list[asyncio.Task] = []
        self.relay, self.polls = relay_metrics()
        self.reroutes = Counter("tandem:request_reroutes_total",
                                "Requests re-routed after a transfer failure or a worker death, before any token",
                                registry=None)
        self.refusals = Counter("tandem:requests_refused_total",
                                "Requests refused at arrival because the workers could not serve them promptly (429)",
                                ["role"], registry=None)
        self.extra_collectors = [self.relay, self.polls, self.reroutes, self.refusals]

    # ---- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.refresh()
        self._tasks.append(asyncio.create_task(self._refresh_forever(), name="dispatcher-refresh"))

    async def close(self) -> None:
        """Abort everything still in flight (their streams end with an error), then stop every task."""
        for flight in list(self.flights.values()):
            # Not `abort` alone: a consumer still iterating would wait forever for a last chunk.
            self._shut_down(flight)
        for live in self.lives.values():
            await self._flush(live)
        for task in self._tasks + [t for live in self.lives.values() for t in live.tasks]:
            task.cancel()
        await asyncio.gather(*self._tasks, *(t for live in self.lives.values() for t in live.tasks),
                             return_exceptions=True)

    async def drain(self, timeout_s: float) -> int:
        """Wait up to `timeout_s` for in-flight requests to finish; abort the rest. Returns how
        many were aborted."""
        deadline = time.monotonic() + timeout_s
        while self.flights and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = list(self.flights.values())
        for flight in left:
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
                continue
            if info.alive:  # first, so requests of the old incarnation can be re-routed to the new one
                self._adopt(info)
            if live is not None:
                self._worker_gone(live, f"replaced by incarnation {info.incarnation}")

    # ---- Backend -----------------------------------------------------------------------------------
    def generate(self, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams) -> AsyncIterator[GenerationChunk]:
        """Route the request now (raising `BackendError` when it cannot start) and return its stream."""
        if request_id in self.flights:
            raise BackendError(ErrorKind.REJECTED, f"request id {request_id!r} is already in flight")
        if len(self.flights) >= self.max_pending:
            raise BackendError(ErrorKind.QUEUE_FULL, f"{len(self.flights)} requests in flight; retry later",
                               retry_after_s=1.0)
        flight = _Flight(request_id, list(prompt_token_ids), params, submitted_at=self.clock(),
                         found_idle=not self.flights)
        self._route(flight, admit=True)  # raises BackendError before anything is registered
        self.flights[request_id] = flight
        return self._stream(flight)

    async def abort(self, request_id: str) -> None:
        flight = self.flights.pop(request_id, None)
        if flight is None:
            return
        self._abort_on_worker(flight)
        self._end(flight)

    def num_requests(self) -> tuple[int, int]:
        waiting = sum(f.phase in (Phase.QUEUED, Phase.RESERVING, Phase.BACKOFF) for f in self.flights.values())
        return len(self.flights) - waiting, waiting

    def worker_gauges(self) -> list[WorkerGauge]:
        return [live.gauge() for live in sorted(self.lives.values(), key=lambda lv: lv.worker_id)]

    def worker_details(self) -> list[dict]:
        """Each worker's identity and last heartbeat stats, as plain JSON-able dicts."""
        return [live.details() for live in sorted(self.lives.values(), key=lambda lv: lv.worker_id)]

    # ---- routing -----------------------------------------------------------------------------------
    def _route(self, flight: _Flight, *, admit: bool) -> None:
        """Pick its workers and queue it on its prefill worker's lane (or send it to its decode worker
        to prefill locally). `admit`: a new arrival, refused (429) when no worker can take it promptly;
        a request admitted before (re-routed, back from a full host tier) goes to the front instead."""
        lives = [lv for lv in self.lives.values() if not lv.gone]
        views = [lv.view() for lv in lives]
        if admit:
            views = self._admissible(lives, views)
        request = RequestView(flight.request_id, tuple(flight.prompt), flight.params.max_tokens)
        try:
            route = choose(self.policy, request, views, self.state, self.policy_params)
        except NoWorkerAvailable as exc:
            raise BackendError(ErrorKind.UNAVAILABLE, f"no worker can serve requests now: {exc}",
                               retry_after_s=5.0) from None
        self.state.record(request, route)
        flight.decode = self.lives[route.decode_id]
        flight.prefill = self.lives[route.prefill_id] if route.prefill_id else None
        flight.decode.num_active += 1
        if admit:  # its first token will be a sample for its decode worker's limit
            flight.limit_epoch = flight.decode.limit.epoch
        self._by_wire[flight.wire_id] = flight
        if flight.prefill is None:
            flight.phase = Phase.LOCAL
            self._send(flight.decode, p.Generate(flight.wire_id, request.prompt_token_ids, flight.params))
            return
        flight.phase = Phase.QUEUED
        flight.prefill.lane.enqueue(flight, len(flight.prompt), front=not admit)
        self._pump(flight.prefill)

    def _admissible(self, lives: list[LiveWorker], views: list) -> list:
        """The views of the workers that can take a new request now; raises QUEUE_FULL (429) when a
        needed role has none."""
        now, unloaded_s = self.clock(), self.unloaded_ttft.value_s
        refusals = {}
        for live in lives:
            refusal = (live.lane.refusal(self.admission, now, unloaded_s) if live.info.role is WorkerRole.PREFILL
                       else live.limit.refusal(live.num_active))
            if refusal is not None:
                refusals[live.worker_id] = refusal
        try:
            return admissible(views, refusals)
        except Overloaded as exc:
            self.refusals.labels(role=exc.role).inc()
            raise BackendError(ErrorKind.QUEUE_FULL, f"the server is at capacity ({exc}); retry later",
                               retry_after_s=exc.refusal.retry_after_s) from None

    def _pump(self, prefill: LiveWorker) -> None:
        """Reserve landings for the queued requests that fit the prefill worker's window now."""
        if prefill.gone:
            return
        for flight, num_tokens in prefill.lane.take_ready():
            flight.phase = Phase.RESERVING
            if flight.reserve_started_at is None:
                flight.reserve_started_at = self.clock()
            self._transfers[flight.wire_id] = _Transfer(prefill, flight.decode, num_tokens)
            self._send(flight.decode, p.Reserve(flight.wire_id, tuple(flight.prompt), flight.params, prefill.peer_id))

    def _reroute(self, flight: _Flight, why: str) -> bool:
        """Try the request again on a fresh route. False when it may not (retries spent, tokens
        already sent, no worker) — the caller then fails it."""
        if flight.tokens_sent or flight.attempt >= self.max_transfer_retries:
            return False
        self._unroute(flight)
        flight.attempt += 1
        log.warning("re-routing %s (attempt %d): %s", flight.request_id, flight.attempt, why)
        self.reroutes.inc()
        try:
            self._route(flight, admit=False)
        except BackendError:
            return False
        return True

    def _unroute(self, flight: _Flight) -> None:
        """Undo `_route`'s bookkeeping (the transfer, if any, ends on its own messages)."""
        self._by_wire.pop(flight.wire_id, None)
        flight.found_idle, flight.limit_epoch = False, None  # a later route's TTFT is no admission sample
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
        elif isinstance(msg, (p.KVProgress, p.KVComplete, p.TransferAborted)):
            self._relay_to_decode(msg)
        elif isinstance(msg, p.AbortTransfer):
            transfer = self._transfers.get(msg.request_id)
            if transfer is not None:
                self._send(transfer.prefill, msg)
        elif isinstance(msg, p.WorkerCrashed):
            self._worker_gone(live, f"crashed:\n{msg.error}")
        else:
            log.warning("unexpected message from %s: %r", live.worker_id, msg)

    def _on_reserved(self, msg: p.Reserved) -> None:
        flight = self._by_wire.get(msg.request_id)
        transfer = self._transfers.get(msg.request_id)
        if msg.error:
            self._transfer_over(msg.request_id)
            if flight is not None:
                self._finish_error(flight, ErrorKind.REJECTED, msg.error)
        elif msg.landing is None:  # host tier full: the decode worker holds nothing for it
            self._transfer_over(msg.request_id)
            if flight is not None:
                self._unroute(flight)
                flight.phase = Phase.BACKOFF
                asyncio.get_running_loop().call_later(self.reserve_retry_s, self._retry_reserve, flight)
        elif transfer is None or transfer.prefill.gone:
            if transfer is not None:  # its prefill worker died meanwhile: the decode side frees it
                self._send(transfer.decode, p.PeerDead(transfer.prefill.peer_id))
        elif flight is None:  # aborted while reserving: the decode worker's Abort already ends it
            pass
        else:
            flight.phase = Phase.PREFILLING
            flight.landing_bytes = len(msg.landing.page_ids) * msg.landing.layout.page_bytes
            transfer.prefill_sent = True
            transfer.prefill.lane.rate.started(self.clock(), transfer.prompt_len)
            self._send(transfer.prefill, p.Prefill(msg.request_id, tuple(flight.prompt), flight.params, msg.landing))

    def _retry_reserve(self, flight: _Flight) -> None:
        if flight.phase is not Phase.BACKOFF or self.flights.get(flight.request_id) is not flight:
            return
        if self.clock() - flight.reserve_started_at > self.landing_timeout_s:  # host tiers stay full
            self._finish_error(flight, ErrorKind.UNAVAILABLE,
                               f"no decode worker had room to land the prompt within {self.landing_timeout_s}s")
            return
        try:
            self._route(flight, admit=False)
        except BackendError as exc:
            self._finish_error(flight, exc.kind, exc.message)

    def _relay_to_decode(self, msg) -> None:
        transfer = self._transfers.get(msg.request_id)
        if transfer is None:
            return
        if not transfer.decode.gone:
            self._send(transfer.decode, msg)
        if isinstance(msg, p.KVComplete):
            self._transfer_over(msg.request_id, delivered=True)
        elif isinstance(msg, p.TransferAborted):
            self._transfer_over(msg.request_id)

    def _transfer_over(self, wire_id: str, delivered: bool = False) -> None:
        """The prefill worker is done with it (or gone): its window share goes to the next in queue."""
        transfer = self._transfers.pop(wire_id, None)
        if transfer is None:
            return
        lane = transfer.prefill.lane
        lane.leave_window(transfer.prompt_len)
        if transfer.prefill_sent:
            lane.rate.finished(self.clock(), transfer.prompt_len, delivered)
        self._pump(transfer.prefill)

    def _on_tokens(self, live: LiveWorker, msg: p.TokenOutput) -> None:
        flight = self._by_wire.get(msg.request_id)
        if flight is None or flight.decode is not live or flight.phase is Phase.DONE:
            return
        if msg.emitted_unix_s:
            self.relay.observe(max(0.0, time.time() - msg.emitted_unix_s))
        if msg.error:
            if msg.failure == "rejected":
                self._finish_error(flight, ErrorKind.REJECTED, msg.error)
            elif msg.failure == "internal":  # the worker's fault serving this request: a retry meets it again
                self._finish_error(flight, ErrorKind.INTERNAL, msg.error)
            elif not self._reroute(flight, msg.error):
                self._finish_error(flight, ErrorKind.UNAVAILABLE, msg.error)
            return
        if flight.tokens_sent == 0:
            self._observe_ttft(flight, self.clock() - flight.submitted_at)
        flight.phase = Phase.STREAMING
        flight.tokens_sent += len(msg.new_token_ids)
        if msg.finish_reason is None:
            flight.queue.put_nowait(GenerationChunk(tuple(msg.new_token_ids)))
            return
        timings = dict(msg.timings)
        transfer_s = (timings["transfer_done"] - timings["first_write"]
                      if "transfer_done" in timings and "first_write" in timings else None)
        flight.queue.put_nowait(GenerationChunk(
            tuple(msg.new_token_ids), msg.finish_reason, cached_tokens=msg.cached_tokens, kv_transfer_s=transfer_s,
            kv_transfer_bytes=flight.landing_bytes if flight.prefill else 0,
            prefill_worker=flight.prefill.worker_id if flight.prefill else "", decode_worker=live.worker_id))
        self._end(flight)

    def _observe_ttft(self, flight: _Flight, ttft_s: float) -> None:
        """Admission learns from each first token: the unloaded figure, and whether the decode
        worker's limit kept its promise."""
        if flight.found_idle:
            self.unloaded_ttft.observe(ttft_s)
        aim_s = ttft_aim_s(self.admission, self.unloaded_ttft.value_s)
        if flight.limit_epoch is not None and aim_s is not None:
            flight.decode.limit.observe(ttft_s, aim_s, flight.limit_epoch, flight.decode.num_active)

    # ---- endings -----------------------------------------------------------------------------------
    def _abort_on_worker(self, flight: _Flight) -> None:
        """Tell the decode worker holding it (if any) to release it; the prefill side follows."""
        if flight.phase in (Phase.RESERVING, Phase.PREFILLING, Phase.LOCAL, Phase.STREAMING):
            self._send(flight.decode, p.Abort(flight.wire_id))

    def _shut_down(self, flight: _Flight) -> None:
        """Shutdown: release it on the workers, then end its stream with an error. In this order:
        `_finish_error` ends the flight, after which `abort` finds nothing to tell the decode worker,
        and the request would run there until its own stop rules."""
        self._abort_on_worker(flight)
        self._finish_error(flight, ErrorKind.UNAVAILABLE, "the server is shutting down")

    def _finish_error(self, flight: _Flight, kind: ErrorKind, error: str) -> None:
        if flight.phase is Phase.DONE:
            return
        flight.queue.put_nowait(GenerationChunk((), "abort", error=error, error_kind=kind))
        self._end(flight)

    def _end(self, flight: _Flight) -> None:
        """The request is over for the dispatcher (the workers release their own KV)."""
        flight.phase = Phase.DONE
        self._unroute(flight)
        self.flights.pop(flight.request_id, None)

    async def _stream(self, flight: _Flight) -> AsyncIterator[GenerationChunk]:
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
        live = LiveWorker(info, PrefillLane(self.admission.prefill_window_tokens, self.admission.rate_smoothing),
                          DecodeLimit(self.admission.max_requests_per_worker, self.admission.rate_smoothing))
        self.lives[info.worker_id] = live
        live.tasks = [asyncio.create_task(self._sender(live), name=f"send-{info.worker_id}"),
                      asyncio.create_task(self._collector(live), name=f"collect-{info.worker_id}")]
        log.info("worker %s (%s, incarnation %d) joined", info.worker_id, info.role.value, info.incarnation)

    def _worker_gone(self, live: LiveWorker, why: str) -> None:
        """Fail or re-route what it held, tell the survivors, forget its prefix tree."""
        if live.gone:
            return
        live.gone = True
        log.error("worker %s (incarnation %d) is gone: %s", live.worker_id, live.info.incarnation, why)
        for task in live.tasks:
            if task is not asyncio.current_task():
                task.cancel()
        self.state.forget_worker(live.worker_id)
        survivors = [lv for lv in self.lives.values() if not lv.gone]
        if live.info.role is WorkerRole.PREFILL:
            for lv in survivors:  # they free every landing this incarnation may have been writing
                self._send(lv, p.PeerDead(live.peer_id))
        else:
            for lv in survivors:
                if lv.info.role is WorkerRole.PREFILL:
                    self._send(lv, p.PeerDead(live.info.session))
        # Queued ones first, so that a window freed below is never handed to a request bound for `live`.
        queued = live.lane.drain() + [f for f in self.flights.values() if f.decode is live and f.phase is Phase.QUEUED]
        for flight in queued:  # never handed to a worker: routed afresh, not a re-route
            self._unroute(flight)
            try:
                self._route(flight, admit=False)
            except BackendError as exc:
                self._finish_error(flight, exc.kind, exc.message)
        for wire, transfer in list(self._transfers.items()):
            if live in (transfer.prefill, transfer.decode):
                self._transfer_over(wire)
        for flight in [f for f in self.flights.values() if f.decode is live]:
            if not self._reroute(flight, f"worker {live.worker_id} died"):
                self._finish_error(flight, ErrorKind.UNAVAILABLE, f"worker {live.worker_id} died: {why}")

    def _send(self, live: LiveWorker | None, msg) -> None:
        if live is None or live.gone:
            return
        live.outq.append(msg)
        live.wake.set()

    async def _flush(self, live: LiveWorker) -> None:
        if live.outq and not live.gone:
            msgs, live.outq = live.outq, []
            try:
                await live.info.link.send(msgs)
            except Exception as exc:  # noqa: BLE001 - any failure to reach it means it is gone
                self._worker_gone(live, f"send failed: {exc}")

    async def _sender(self, live: LiveWorker) -> None:
        while not live.gone:
            await live.wake.wait()
            live.wake.clear()
            await self._flush(live)

    async def _collector(self, live: LiveWorker) -> None:
        while not live.gone:
            try:
                msgs = await live.info.link.collect(self.collect_timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the link failing is how death shows up here
                self._worker_gone(live, f"collect failed: {type(exc).__name__}: {exc}")
                return
            if msgs:
                self.polls.labels(role=live.info.role.value).inc()
            for msg in msgs:
                self._on_message(live, msg)

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_interval_s)
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - keep serving with stale views; say so
                log.exception("refreshing worker views failed")
