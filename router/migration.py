"""Streams that outlive their worker (docs/design.md §10): a request whose decode (or colocated)
worker died after tokens reached the client resumes on another worker that decodes, from its prompt
plus the tokens already streamed (`Generate.resume_output`; the engine prefills both through its
prefix cache and tiers and continues as a retracted request does: `engine/request.py:Request.resume`).
With its seed (the dispatcher gives every request one) the continuation is token-identical to an
undisturbed run, so the client sees one stream, no token repeated or missing.

A stream with no worker to resume on (the default cluster has one decode worker) waits, parked here,
for one to join (the dead one's restart) for at most `MigrationParams.timeout_s`; only past it, or
past `max_migrations` deaths, does it end with the clean error a dead worker gave before.

A worker being drained (a rolling restart, SIGTERM: `cluster.serve.controller.restart_worker`) moves
its streams the same way before it stops, when a peer can take them; with none they run on there,
and what is left at the stop resumes as after a death.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
from collections.abc import Iterable
from dataclasses import dataclass

from common import protocol as p
from common.config import SamplingParams, require
from common.protocol import WorkerRole
from router.backend import BackendError, ErrorKind
from router.flights import Flight, Phase
from router.workers import LiveWorker

log = logging.getLogger("tandem.dispatcher")
RESUMERS = (WorkerRole.DECODE, WorkerRole.COLOCATED)
"""The roles a stream resumes on: they decode (a prefill worker only ships KV)."""


def resumers(lives: Iterable[LiveWorker], but: LiveWorker | None = None) -> list[LiveWorker]:
    """The live workers a stream can resume on: they decode, and are not draining (nor `but`)."""
    return [lv for lv in lives if not lv.gone and lv.info.alive and not lv.info.draining
            and lv.info.role in RESUMERS and lv is not but]


def seeded(params: SamplingParams) -> SamplingParams:
    """`params` with a seed (drawn here when it has none), so that a stream resumed on another worker
    continues with the draws it would have had."""
    return params if params.seed is not None else dataclasses.replace(params, seed=secrets.randbits(62))


@dataclass(frozen=True)
class MigrationParams:
    max_migrations: int = 2
    """Times one request's stream moves to another worker at most (>= 0; 0: a dead worker's streams
    end with an error, as before)."""
    timeout_s: float = 30.0
    """How long a stream whose worker died waits for a worker to resume on (> 0)."""

    def __post_init__(self):
        require(isinstance(self.max_migrations, int) and self.max_migrations >= 0,
                f"max_migrations must be an integer >= 0, got {self.max_migrations!r}")
        require(isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0,
                f"migration_timeout_s must be > 0, got {self.timeout_s!r}")


@dataclass(eq=False)
class Parked:
    flight: Flight
    deadline: float  # dispatcher clock
    why: str  # how its worker died

    def error(self, params: MigrationParams) -> str:
        return f"{self.why}; no worker could resume its stream within {params.timeout_s:g} s"


class Migrations:
    """The streams waiting for a worker to resume on, and the counters of what became of them."""

    def __init__(self, params: MigrationParams) -> None:
        from prometheus_client import Counter

        self.params = params
        self.parked: list[Parked] = []
        self.counter = Counter("tandem:request_migrations_total",
                               "Streams whose worker died mid-stream, by outcome: resumed on another worker, or "
                               "failed (no worker within the timeout, or past the migration limit)",
                               ["outcome"], registry=None)

    def wants(self, flight: Flight) -> bool:
        """Whether `flight`, whose worker just died (and which no re-route took), should resume on
        another worker: within the per-request limit."""
        if flight.phase is Phase.DONE:
            return False
        if flight.migrations >= self.params.max_migrations:
            self.counter.labels(outcome="failed").inc()
            return False
        return True

    def leaving(self, draining: LiveWorker, flights: Iterable[Flight], lives: Iterable[LiveWorker]) -> list[Flight]:
        """The streams to move off `draining` now: those it decodes, within the limit (the others run
        on there), when a peer can take them (none: all run on)."""
        if not resumers(lives, but=draining):
            return []
        return [f for f in flights if f.decode is draining and f.phase in (Phase.LOCAL, Phase.STREAMING)
                and f.migrations < self.params.max_migrations]

    def hold(self, flight: Flight, error: BackendError, lives: Iterable[LiveWorker], now: float) -> None:
        """A new request no worker can decode now (`error`, 503): it waits as a parked stream (with no
        output yet) while a worker that decodes is draining or restarting (known, not alive); else
        `error` is raised."""
        lives = list(lives)
        coming_back = [lv for lv in lives if lv.info.role in RESUMERS and (lv.gone or lv.info.draining)]
        if error.kind is not ErrorKind.UNAVAILABLE or not coming_back or resumers(lives):
            raise error
        self.park(flight, now, error.message)

    def park(self, flight: Flight, now: float, why: str) -> None:
        flight.move(Phase.MIGRATING)
        self.parked.append(Parked(flight, now + self.params.timeout_s, why))

    def take(self, lives: Iterable[LiveWorker], now: float) -> tuple[list[tuple[Flight, LiveWorker]], list[Parked]]:
        """(parked streams with the worker each resumes on now, those out of time); the rest stay
        parked. Ended ones (the client went away) are dropped."""
        self.parked = [park for park in self.parked if park.flight.phase is Phase.MIGRATING]
        ready, expired, waiting = [], [], []
        workers = resumers(lives)
        for park in self.parked:
            if workers:
                worker = min(workers, key=lambda lv: lv.num_active)
                ready.append((park.flight, worker))
                worker.num_active += 1  # counted now, so the next pick sees it
            elif now >= park.deadline:
                expired.append(park)
            else:
                waiting.append(park)
        self.parked = waiting
        self.counter.labels(outcome="resumed").inc(len(ready))
        self.counter.labels(outcome="failed").inc(len(expired))
        return ready, expired

    @staticmethod
    def resume(flight: Flight, worker: LiveWorker) -> p.Generate:
        """`flight` (taken for `worker`) moved there: the message that resumes it after its output."""
        flight.attempt, flight.migrations, flight.decode = flight.attempt + 1, flight.migrations + 1, worker
        flight.move(Phase.LOCAL)
        log.warning("resuming %s on %s after %d tokens", flight.request_id, worker.worker_id, flight.tokens_sent)
        return p.Generate(flight.wire_id, tuple(flight.prompt), flight.params, "", tuple(flight.output))
