"""Streaming sessions as the dispatcher sees them: which worker incarnation holds each open session,
the opens still waiting for their `SessionOpened`, the sessions orphaned by a dead worker, and those lost.

A session lives on one decode or colocated worker, which pins its history between turns
(`engine/sessions.py`). So its turns are never routed: each goes to that worker as a
`Generate` with `session_id` (local prefill: no prefill worker, no landing) and is never re-routed;
the pinned history is what makes the turn cheap, and no other worker has it.

    open_session --choose_session_worker--> OpenSession --SessionOpened("")--> held (turns go there)
                                                        | error: budget full -> 429, else 400
                                                        | no answer in time: 503 (a late success is closed)
    held --close_session--> CloseSession, forgotten
    held --its worker dies--> orphaned: its next turn opens it again on a live worker (OpenSession then
                              the turn, in order) and runs there, its history prefilled through that
                              worker's prefix cache and tiers (the turn running at the death resumed
                              there as a plain request: `router.migration`); an orphan left idle past
                              its idle_timeout_s is lost: told why once, then unknown

The worker may also close a session on its own (idle past `idle_timeout_s`); the dispatcher does not
hear of it, and a later turn is rejected by the worker ("not open").
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from common import protocol as p
from common.protocol import WorkerRole
from router.backend import BackendError, ErrorKind
from router.flights import Flight
from router.policy import NoWorkerAvailable
from router.workers import LiveWorker

SESSION_ROLES = (WorkerRole.DECODE, WorkerRole.COLOCATED)
BUDGET_FULL = "budget full"  # how a worker's SessionOpened error says its session KV budget is spent


@dataclass(eq=False)
class SessionTurn(Flight):
    """A turn of a streaming session: pinned to the worker holding the session, never re-routed."""

    session_id: str = ""


def choose_session_worker(candidates: Iterable[tuple[str, int, int]]) -> str:
    """The worker a new session goes to: fewest sessions, then fewest active requests, then name.
    `candidates`: (worker id, sessions held, active requests) of each live decode/colocated worker."""
    best = min(candidates, key=lambda c: (c[1], c[2], c[0]), default=None)
    if best is None:
        raise NoWorkerAvailable("no decode or colocated worker is alive to hold a session")
    return best[0]


class SessionTable:
    """The dispatcher's sessions. Runs on the dispatcher's loop; never touches KV."""

    def __init__(self) -> None:
        self._held: dict[str, LiveWorker] = {}
        self._opening: dict[str, tuple[LiveWorker, asyncio.Future]] = {}
        self._lost: dict[str, str] = {}  # session id -> why it is gone (told once)
        self._params: dict[str, tuple[int, float]] = {}  # open session -> (capacity_tokens, idle_timeout_s)
        self._orphans: dict[str, tuple[str, float]] = {}  # session whose worker died -> (why, since: monotonic)
        self.reopened = 0  # orphans opened again on another worker

    async def open(self, lives: Iterable[LiveWorker], capacity_tokens: int, idle_timeout_s: float,
                   timeout_s: float) -> str:
        """Open a session on the chosen worker; its id. Raises BackendError: UNAVAILABLE (no worker,
        no answer within `timeout_s`, the worker died), QUEUE_FULL (its budget is full), REJECTED."""
        live = self._choose(lives)
        session_id = f"sess-{uuid.uuid4().hex}"
        reply = asyncio.get_running_loop().create_future()
        self._opening[session_id] = (live, reply)
        live.send(p.OpenSession(session_id, capacity_tokens, idle_timeout_s))
        try:
            error = await asyncio.wait_for(asyncio.shield(reply), timeout_s)
        except asyncio.TimeoutError:
            raise BackendError(ErrorKind.UNAVAILABLE, f"worker {live.worker_id} did not answer the session open "
                                                      f"within {timeout_s} s", retry_after_s=1.0) from None
        finally:
            self._opening.pop(session_id, None)  # a late answer then finds nobody waiting: see on_opened
        if error:
            kind = ErrorKind.QUEUE_FULL if BUDGET_FULL in error else ErrorKind.REJECTED
            raise BackendError(kind, error, retry_after_s=1.0 if kind is ErrorKind.QUEUE_FULL else None)
        if live.gone:
            raise BackendError(ErrorKind.UNAVAILABLE, f"worker {live.worker_id} died while opening the session")
        self._held[session_id] = live
        self._params[session_id] = (capacity_tokens, idle_timeout_s)
        return session_id

    def on_opened(self, live: LiveWorker, msg: p.SessionOpened) -> None:
        waiting = self._opening.get(msg.session_id)
        if waiting is not None and waiting[0] is live:
            if not waiting[1].done():
                waiting[1].set_result(msg.error)
        elif msg.error and self._held.get(msg.session_id) is live:  # an orphan's open failed: its turn fails
            if BUDGET_FULL in msg.error:  # no room there now (its turn gets 429): an orphan still
                del self._held[msg.session_id]
                self._orphans[msg.session_id] = (f"no worker had room to open it again ({msg.error})", time.monotonic())
            else:
                self._forget(msg.session_id, f"opening it again on worker {live.worker_id} failed: {msg.error}")
        elif not msg.error and msg.session_id not in self._held:  # opened after its caller gave up
            live.send(p.CloseSession(msg.session_id))

    def worker_of(self, session_id: str, lives: Iterable[LiveWorker] = ()) -> LiveWorker:
        """The worker holding the session (an orphan is opened again on one of `lives` first, its
        `OpenSession` sent ahead of the turn); BackendError NOT_FOUND when it is not open here,
        UNAVAILABLE while an orphan has no live worker to go to."""
        live = self._held.get(session_id)
        if live is not None:
            return live
        if session_id in self._orphans:
            why, since = self._orphans[session_id]
            capacity, idle_timeout_s = self._params[session_id]
            if time.monotonic() - since <= idle_timeout_s:
                live = self._choose(lives)
                del self._orphans[session_id]
                self._held[session_id] = live
                live.send(p.OpenSession(session_id, capacity, idle_timeout_s))
                self.reopened += 1
                return live
            self._forget(session_id, why)
        lost = self._lost.pop(session_id, None)
        if lost is not None:
            raise BackendError(ErrorKind.NOT_FOUND, f"session {session_id!r} is lost: {lost}; open a new one")
        raise BackendError(ErrorKind.NOT_FOUND, f"session {session_id!r} is not open (closed, or never opened)")

    def close(self, session_id: str) -> bool:
        """Forget it and tell its worker; False when it was not open (a lost one is forgotten too)."""
        live = self._held.pop(session_id, None)
        self._params.pop(session_id, None)
        if live is None:
            return (self._orphans.pop(session_id, None) or self._lost.pop(session_id, None)) is not None
        live.send(p.CloseSession(session_id))
        return True

    def worker_gone(self, live: LiveWorker, why: str) -> None:
        """Its sessions are orphaned (their pinned KV died with it: the next turn opens them again on
        another worker); opens waiting on it fail."""
        first_line = next((line.strip() for line in why.splitlines() if line.strip()), "no reason given")
        for session_id in [s for s, held in self._held.items() if held is live]:
            del self._held[session_id]
            self._orphans[session_id] = (f"its worker {live.worker_id} died ({first_line})", time.monotonic())
        for held, reply in self._opening.values():
            if held is live and not reply.done():
                reply.set_exception(BackendError(ErrorKind.UNAVAILABLE, f"worker {live.worker_id} died while "
                                                                        "opening the session", retry_after_s=1.0))

    def _forget(self, session_id: str, why: str) -> None:
        """Lost for good: its next turn (or close) is told why, once."""
        self._held.pop(session_id, None)
        self._params.pop(session_id, None)
        self._orphans.pop(session_id, None)
        self._lost[session_id] = why

    def _choose(self, lives: Iterable[LiveWorker]) -> LiveWorker:
        candidates = {lv.worker_id: lv for lv in lives if not lv.gone and lv.info.role in SESSION_ROLES}
        counts = Counter(held.worker_id for held in self._held.values())
        try:
            worker_id = choose_session_worker((wid, counts[wid], lv.num_active) for wid, lv in candidates.items())
        except NoWorkerAvailable as exc:
            raise BackendError(ErrorKind.UNAVAILABLE, str(exc), retry_after_s=5.0) from None
        return candidates[worker_id]
