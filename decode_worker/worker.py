"""The workers that speak for clients, behind the worker contract (`common.protocol.Worker`).

    ColocatedWorker  the engine alone (NullConnector): `Generate` (prefill and decode here), `Abort`
    DecodeWorker     the engine with a `KVReceiver`: also `Reserve` a landing, then `KVProgress` /
                     `KVComplete` / `TransferAborted` from its prefill worker (relayed by the dispatcher);
                     without inbound traffic it prefills locally, as a colocated worker does

Their step's outputs become `TokenOutput`s for the dispatcher.
"""

from __future__ import annotations

import time

from common import protocol as p
from common.protocol import WorkerRole
from decode_worker.receiver import InboundPhase, KVReceiver
from engine.core import EngineCore
from engine.hosted import EngineWorker
from engine.output import StepOutput
from engine.sessions import SessionBusy, SessionError

__all__ = ["ColocatedWorker", "DecodeWorker", "InboundPhase"]

LANDING_WAIT_S = 0.05
"""The longest a decode worker with only landings in flight waits for a message between steps."""


def token_output(out: StepOutput) -> p.TokenOutput:
    return p.TokenOutput(out.request_id, tuple(out.new_token_ids), out.finish_reason, out.error, out.cached_tokens,
                         out.timings, time.time(), out.failure, out.logprobs, out.prompt_logprobs, out.cached_tiers)


class ColocatedWorker(EngineWorker):
    """Not thread-safe: one loop calls `handle` and `step`."""

    role = WorkerRole.COLOCATED

    # ---- the worker contract -----------------------------------------------------------------------
    def handle(self, msg) -> list:
        if isinstance(msg, p.Generate):
            try:
                self.engine.add_request(list(msg.prompt_token_ids), msg.params, msg.request_id, msg.session_id,
                                        msg.resume_output)
            except ValueError as exc:  # SessionError too; SessionBusy: no room now, a retry may find some
                failure = p.Failure.BUSY if isinstance(exc, SessionBusy) else p.Failure.REJECTED
                return [p.TokenOutput(msg.request_id, (), p.FinishReason.ABORT, str(exc), failure=failure)]
        elif isinstance(msg, p.OpenSession):
            try:
                self.engine.open_session(msg.session_id, msg.capacity_tokens, msg.idle_timeout_s)
            except SessionError as exc:
                return [p.SessionOpened(msg.session_id, str(exc))]
            return [p.SessionOpened(msg.session_id, "")]
        elif isinstance(msg, p.CloseSession):
            self.engine.close_session(msg.session_id)
        elif isinstance(msg, p.Abort):
            self.abort(msg.request_id)
        elif not isinstance(msg, p.PeerDead):  # no peers: nothing to do
            raise TypeError(f"a {self.role.value} worker cannot handle {type(msg).__name__}")
        return []

    def fail(self, msg, error: str) -> list:
        """A fault while handling `msg` (about one request): release what it holds, tell its client."""
        self.abort(msg.request_id)
        return [p.TokenOutput(msg.request_id, (), p.FinishReason.ABORT, error, failure=p.Failure.INTERNAL)]

    def step(self) -> list:
        return [token_output(out) for out in self.engine.step()]

    def stats(self) -> p.WorkerStats:
        return self.engine.stats(self.role)

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)


class DecodeWorker(ColocatedWorker):
    role = WorkerRole.DECODE

    def __init__(self, engine: EngineCore):
        """`engine`: built with a `KVReceiver` (`cluster/worker_host/build.py:make_worker`)."""
        assert isinstance(engine.connector, KVReceiver), "a decode worker's engine lands KV through a KVReceiver"
        super().__init__(engine)
        self.receiver: KVReceiver = engine.connector

    def handle(self, msg) -> list:
        if isinstance(msg, p.Reserve):
            try:
                landing = self.receiver.reserve(msg.request_id, list(msg.prompt_token_ids), msg.params, msg.peer)
            except ValueError as exc:
                return [p.Reserved(msg.request_id, None, str(exc))]
            return [p.Reserved(msg.request_id, landing, "")]
        if isinstance(msg, (p.KVProgress, p.KVComplete, p.TransferAborted)):
            self.receiver.on_message(msg)
            return []
        if isinstance(msg, p.PeerDead):
            self.receiver.peer_dead(msg.peer)
            return []
        return super().handle(msg)

    def fail(self, msg, error: str) -> list:
        replies = super().fail(msg, error)
        if isinstance(msg, p.Reserve):  # the dispatcher also waits for the answer to a reservation
            replies.append(p.Reserved(msg.request_id, None, error))
        return replies

    def step(self) -> list:
        out = super().step()
        out += [msg for _, msg in self.receiver.outbox]  # the dispatcher knows each transfer's peer
        self.receiver.outbox.clear()
        return out

    def stats(self) -> p.WorkerStats:
        return self.engine.stats(self.role, self.receiver.landing.pool, len(self.receiver.inbound))

    def wait_s(self) -> float:
        """Landings only (the peer's messages move them and wake the loop): up to the nearest
        deadline, at most `LANDING_WAIT_S`. Polling them every 2 ms instead cost the loop ~40% of a
        core through a 1k-token prefill beside it, which slowed that prefill 2x on 2 cores."""
        engine = self.engine
        if not self.receiver.only_landings() or engine.host_cache.busy() or engine.sessions.reap_due():
            return super().wait_s()
        return max(super().wait_s(), min(LANDING_WAIT_S, self.receiver.next_deadline_s()))

    def max_request_tokens(self) -> int:
        """The context limit and the device pool: not the landing, since a prompt longer than it is
        prefilled here (`router.policy.choose`)."""
        return self.engine.max_request_tokens()

    def abort(self, request_id: str) -> bool:
        return self.receiver.abort(request_id) or self.engine.abort(request_id)
