"""Every way a request ends in one engine, and so leaves the engine's table of requests.

    finish(req, reason)        now, through the release path (`Scheduler.finish` -> `KVManager.release`)
    finished(req, reason)      it produced its last token: `finish`, unless the connector holds its KV
                               on (then it only leaves the batch, and comes back through `release_held`)
    failed(req, error, ...)    a fault of its own ended it: ABORT with `error` for its client, the same
                               two ways
    end_held(req, error)       held for its grammar's compile: it holds no KV, nothing to release
    end_stopped()              the connector stopped serving it (an aborted transfer)
    release_held()             the connector no longer holds its KV: released now

The engine's step decides when a request ends; this object is how. It holds the table and the parts a
release touches (scheduler, connector, sessions), never the engine.
"""

from __future__ import annotations

from common.protocol import Failure
from engine.connector import KVConnector
from engine.output import StepOutput, step_output
from engine.request import FinishReason, Request, RequestStatus
from engine.scheduler import Scheduler
from engine.sessions import NullSessions, SessionManager


class Endings:
    def __init__(self, requests: dict[str, Request], scheduler: Scheduler, connector: KVConnector,
                 sessions: SessionManager | NullSessions):
        """`requests`: the engine's table (by id); a request that ends leaves it here."""
        self.requests, self.scheduler, self.connector, self.sessions = requests, scheduler, connector, sessions

    def finish(self, req: Request, reason: FinishReason) -> None:
        """End `req` now through the release path."""
        self.scheduler.finish(req, reason)
        self.requests.pop(req.request_id, None)

    def finished(self, req: Request, reason: FinishReason) -> None:
        """`req` produced its last token: the release path, unless the connector holds its KV on."""
        if not self.connector.request_finished(req, reason):
            self.finish(req, reason)
        elif req in self.scheduler.running:
            self.scheduler.detach(req)

    def failed(self, req: Request, error: str, failure: Failure = Failure.INTERNAL) -> list[StepOutput]:
        """A fault of `req`'s own ended it (`error` for its client): ABORT through the release path
        and `failure`, unless the connector ends it its own way (it holds the KV on)."""
        if self.connector.request_failed(req, error, failure):
            if req in self.scheduler.running:
                self.scheduler.detach(req)
            return []
        if req.status is not RequestStatus.FINISHED:
            self.scheduler.finish(req, FinishReason.ABORT)
        self.requests.pop(req.request_id, None)
        req.error = error
        return [step_output(req, [], FinishReason.ABORT, error, failure)]

    def end_held(self, req: Request, error: str = "") -> list[StepOutput]:
        """End a request held for its grammar (it holds no KV): aborted, or its grammar did not compile."""
        self.requests.pop(req.request_id, None)
        if req.session_id:
            self.sessions.abandon_turn(req.session_id, req.request_id)
        req.error = error
        req.finish(FinishReason.ABORT)
        if not error or self.connector.request_failed(req, error, Failure.REJECTED):
            return []
        return [step_output(req, [], FinishReason.ABORT, error, Failure.REJECTED)]

    def end_stopped(self) -> None:
        """Requests the connector stopped serving: those holding no KV end now; running ones leave the
        batch (the connector hands them back through `take_finished` once no transfer reads their KV)."""
        for req in self.connector.take_stopped():
            if req.status in (RequestStatus.WAITING, RequestStatus.LOADING):
                self.finish(req, FinishReason.ABORT)
            elif req in self.scheduler.running:
                self.scheduler.detach(req)

    def release_held(self) -> None:
        """Requests whose KV the connector held on and no longer does: released now."""
        for req, reason in self.connector.take_finished():
            self.scheduler.release_detached(req, reason)
            self.requests.pop(req.request_id, None)
