"""Workers as the dispatcher sees them: how it reaches one (`WorkerLink`), what the controller says
about one (`WorkerInfo`, from a `ViewSource`), and its per-incarnation state (`LiveWorker`).

Per worker incarnation, `LiveWorker` runs two tasks on the dispatcher's loop:

    dispatcher --send(msg)--> outq --sender: link.send(batch), in order--> worker
    dispatcher <--on_message(live, msg)-- collector: link.collect(timeout) (long-poll) <-- worker
    dispatcher <--on_message(live, msg)-- `relay_sink` <-- its relay connection (when it has one)

A link that raises (send or collect) means the worker is gone: the dispatcher hears it through
`on_gone` and the tasks end.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, overload

from common import protocol as p
from common.protocol import WorkerRole
from router.admission import AdmissionParams, DecodeLimit, ItemT, PrefillLane, Refusal
from router.backend import WorkerGauge
from router.policy_types import WorkerView

log = logging.getLogger("tandem.dispatcher")


class WorkerLink(Protocol):
    async def send(self, msgs: list) -> None:
        """Deliver `msgs` in order. Raises when the worker is gone."""

    async def collect(self, timeout_s: float) -> list:
        """Messages the worker sent since the last call (waits up to `timeout_s` for one).
        Raises when the worker is gone."""

    relays: bool
    """Whether the worker at the other end can send its messages over the token relay
    (`common/relay.py`: a `WorkerHost`'s queues can, a worker process's pipe cannot)."""


@dataclass(frozen=True)
class WorkerInfo:
    """The controller's view of one worker incarnation."""

    worker_id: str
    role: WorkerRole
    incarnation: int  # bumped on every restart: a new process, a new transport session
    alive: bool
    session: str  # its transport session id
    stats: p.WorkerStats | None
    restarts: int
    link: Any  # WorkerLink
    pid: int = 0  # the worker's process id, when known (operators, tests)
    draining: bool = False  # stopping soon (a restart, SIGTERM): route it nothing new, move its streams


class ViewSource(Protocol):
    async def workers(self) -> list[WorkerInfo]: ...


@dataclass(eq=False)
class LiveWorker(Generic[ItemT]):
    """One worker incarnation as the dispatcher sees it: its outbound queue, its tasks, its load."""

    info: WorkerInfo
    lane: PrefillLane[ItemT]  # prefill workers: admitted prompts queued for it and in its window
    limit: DecodeLimit  # decode and colocated workers: how many requests it may hold now
    outq: list = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: list = field(default_factory=list)
    gone: bool = False
    num_active: int = 0  # requests routed here to decode (or prefill locally), from arrival to end
    _on_gone: Callable[[LiveWorker, str], None] | None = field(default=None, init=False, repr=False)

    @classmethod
    def admitting(cls, info: WorkerInfo, admission: AdmissionParams) -> LiveWorker:
        """A new incarnation, with a fresh lane and limit sized by `admission`."""
        return cls(info, PrefillLane(admission.prefill_window_tokens, admission.rate_smoothing),
                   DecodeLimit(admission.max_requests_per_worker, admission.rate_smoothing))

    def refusal(self, admission: AdmissionParams, now: float, num_tokens: int) -> Refusal | None:
        """Why it cannot take one more new request of `num_tokens` prompt tokens now (its lane's or
        its limit's verdict)."""
        if self.info.role is WorkerRole.PREFILL:
            return self.lane.refusal(admission, now, num_tokens)
        return self.limit.refusal(self.num_active)

    def death_notice(self) -> tuple[p.PeerDead, tuple[WorkerRole, ...]]:
        """What the survivors are told when this incarnation dies, and which roles: every worker
        frees the landings a dead prefill worker may have been writing; prefill workers stop
        writing to a dead decode worker (named by its transport session)."""
        if self.info.role is WorkerRole.PREFILL:
            return p.PeerDead(self.peer_id), tuple(WorkerRole)
        return p.PeerDead(self.info.session), (WorkerRole.PREFILL,)

    @property
    def pending_prefill_tokens(self) -> int:
        """Prompt tokens routed here whose prefill has not completed (queued or in the window)."""
        return self.lane.ahead_tokens

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def peer_id(self) -> str:
        """How decode workers name this prefill worker: unique per incarnation, so `PeerDead`
        for a dead incarnation never touches transfers from its successor."""
        return f"{self.info.worker_id}#{self.info.incarnation}"

    # ---- its sender and collector ------------------------------------------------------------------
    def start(self, on_message: Callable[[LiveWorker, object], None], on_gone: Callable[[LiveWorker, str], None],
              collect_timeout_s: float, polls) -> None:
        """Start its two tasks on the running loop. `on_message` gets every message it sends, in
        order; `on_gone` (called at most once per failure, from either task) when its link fails.
        `polls`: the counter of collect calls that returned messages (`relay_metrics`)."""
        self._on_gone = on_gone
        self.tasks = [asyncio.create_task(self._sender(), name=f"send-{self.worker_id}"),
                      asyncio.create_task(self._collector(on_message, collect_timeout_s, polls),
                                          name=f"collect-{self.worker_id}")]

    def send(self, msg) -> None:
        """Queue `msg` for the sender; dropped once the worker is gone."""
        if self.gone:
            return
        self.outq.append(msg)
        self.wake.set()

    async def flush(self) -> None:
        """Send what is queued now (the sender does this on its own; `close` calls it last)."""
        if self.outq and not self.gone:
            msgs, self.outq = self.outq, []
            try:
                await self.info.link.send(msgs)
            except Exception as exc:  # noqa: BLE001 - any failure to reach it means it is gone
                self._gone(f"send failed: {exc}")

    def _gone(self, why: str) -> None:
        assert self._on_gone is not None, f"worker {self.worker_id} lost before `start` gave it an on_gone"
        self._on_gone(self, why)

    def stop(self) -> None:
        """Cancel its tasks (not the one calling, which ends on its own: `gone` is set first)."""
        for task in self.tasks:
            if task is not asyncio.current_task():
                task.cancel()

    async def _sender(self) -> None:
        while not self.gone:
            await self.wake.wait()
            self.wake.clear()
            await self.flush()

    async def _collector(self, on_message, timeout_s: float, polls) -> None:
        while not self.gone:
            try:
                msgs = await self.info.link.collect(timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the link failing is how death shows up here
                self._gone(f"collect failed: {type(exc).__name__}: {exc}")
                return
            self._deliver(msgs, "collect", on_message, polls)

    def relay_sink(self, on_message, polls):
        """(on_messages, on_closed) for its relay connection (`common/relay.py`): each frame's
        messages go to `on_message` as the collector's do; after the relay closes, the worker sends
        on through the long-poll, and its death shows up there."""
        def on_messages(msgs: list) -> None:
            self._deliver(msgs, "relay", on_message, polls)

        def on_closed(why: str) -> None:
            if not self.gone:
                log.info("the relay from %s closed (%s)", self.worker_id, why)
        return on_messages, on_closed

    def _deliver(self, msgs: list, via: str, on_message, polls) -> None:
        """One batch of its messages, in order, whichever way it came."""
        if msgs:
            polls.labels(role=self.info.role.value, via=via).inc()
        for msg in msgs:
            on_message(self, msg)

    # ---- what others see ---------------------------------------------------------------------------
    def view(self) -> WorkerView:
        """What the routing policy sees."""
        stats = self.info.stats
        return WorkerView(self.worker_id, self.info.role, not (self.gone or self.info.draining),
                          num_running=self.num_active, num_waiting=stats.num_waiting if stats else 0,
                          kv_usage=_usage(stats.device) if stats else 0.0,
                          pending_prefill_tokens=self.pending_prefill_tokens,
                          shares_l3=bool(stats and stats.tiers.l3), **_cache_tokens(stats))

    def gauge(self) -> WorkerGauge:
        """What the gateway exports per worker."""
        stats = self.info.stats
        return WorkerGauge(self.worker_id, self.info.role, not self.gone,
                           num_running=stats.num_running if stats else 0,
                           num_waiting=stats.num_waiting if stats else 0,
                           kv_usage=_usage(stats.device) if stats else 0.0,
                           landing_kv_usage=_usage(stats.landing) if stats else None, restarts=self.info.restarts,
                           host_cache_usage=_usage(stats.host_cache) if stats and stats.host_cache else None,
                           tiers=stats.tiers if stats else None, graphs=stats.graphs if stats else None,
                           spec=stats.spec if stats else None, step_threads=stats.step_threads if stats else ())

    def details(self) -> dict:
        """Identity, last heartbeat stats and (prefill workers) what admission measured, as plain
        JSON-able values."""
        out = {"worker_id": self.worker_id, "role": self.info.role.value, "incarnation": self.info.incarnation,
               "alive": not self.gone, "restarts": self.info.restarts, "pid": self.info.pid,
               "session": self.info.session, "stats": dataclasses.asdict(self.info.stats) if self.info.stats else None,
               "num_active": self.num_active, "draining": self.info.draining}
        lane = self.lane
        out["admission"] = ({"queued_requests": lane.num_queued, "queued_tokens": lane.queued_tokens,
                             "window_tokens": lane.window_tokens, "tokens_per_s": lane.rate.tokens_per_s}
                            if self.info.role is WorkerRole.PREFILL else
                            {"limit": int(self.limit.limit), "cuts": self.limit.epoch})
        return out


def _cache_tokens(stats: p.WorkerStats | None) -> dict[str, int]:
    """Tokens a worker's device pool, prefix-cache host tier and landing hold (0: not reported yet)."""
    if stats is None or not stats.tiers.page_size:
        return {}
    page = stats.tiers.page_size
    host = stats.host_cache.total - 1 if stats.host_cache is not None else 0  # less each pool's scratch page
    landing = stats.landing.total if stats.landing is not None else 0  # usable pages: a prompt's whole landing
    return {"device_tokens": (stats.device.total - 1) * page, "host_tokens": max(0, host) * page,
            "landing_tokens": landing * page}


@overload
def _usage(stats: p.PoolStats) -> float: ...
@overload
def _usage(stats: p.PoolStats | None) -> float | None: ...
def _usage(stats: p.PoolStats | None) -> float | None:
    if stats is None:
        return None
    return min(1.0, max(0.0, (stats.total - stats.free) / max(1, stats.total)))


def relay_metrics():
    """The worker -> gateway hop: per-message delay, and how many calls carried the messages."""
    from prometheus_client import Counter, Histogram

    delay = Histogram("tandem:token_relay_seconds",
                      "Worker -> gateway delay of a token message (wall clocks; exact on one host)",
                      buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0), registry=None)
    polls = Counter("tandem:worker_polls_total", "Batches of a worker's messages by how they came: a collect call or a "
                    "relay frame (each carries all the worker sent since the previous one)", ["role", "via"],
                    registry=None)
    return delay, polls
