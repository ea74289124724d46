"""The workers that speak for clients, behind the worker contract (`common.protocol.Worker`).

    ClientWorker     the base of both: `Generate` (prefilled and decoded here), streaming sessions,
                     `Abort`; each step's outputs become `TokenOutput`s for the dispatcher
    ColocatedWorker  a client worker over the engine alone (NullConnector); it has no peers
    DecodeWorker     a client worker whose engine lands KV through a `KVReceiver`: also `Reserve` a
                     landing, then `KVProgress` / `KVComplete` / `TransferAborted` from its prefill
                     worker (relayed by the dispatcher); without inbound traffic it prefills locally,
                     as a colocated worker does

Neither role is a kind of the other: both are client workers, and the decode worker adds the landing.
"""

from __future__ import annotations

import time

from common import protocol as p
from common.protocol import WorkerRole
from decode_worker.receiver import InboundPhase, KVReceiver
from engine.core import EngineCore
from engine.output import StepOutput
from engine.sessions import SessionBusy, SessionError
from engine.worker_base import EngineWorker

__all__ = ["ClientWorker", "ColocatedWorker", "DecodeWorker", "InboundPhase"]

LANDING_WAIT_S = 0.05
"""The longest a decode worker with only landings in flight waits for a message between steps."""


def token_output(out: StepOutput) -> p.TokenOutput:
    return p.TokenOutput(out.request_id, tuple(out.new_token_ids), out.finish_reason, out.error, out.cached_tokens,
                         out.timings, time.time(), out.failure, out.logprobs, out.prompt_logprobs, out.cached_tiers)


class ClientWorker(EngineWorker):
    """Not thread-safe: one loop calls `handle` and `step`."""

    # ---- the messages ------------------------------------------------------------------------------
    def _generate(self, msg: p.Generate) -> list[p.FromWorker]:
        try:
            self.engine.add_request(list(msg.prompt_token_ids), msg.params, msg.request_id, msg.session_id,
                                    msg.resume_output)
        except SessionBusy as exc:  # no room now: a retry may find some
            return [p.TokenOutput(msg.request_id, (), p.FinishReason.ABORT, str(exc), failure=p.Failure.BUSY)]
        except ValueError as exc:  # SessionError too
            return [p.TokenOutput(msg.request_id, (), p.FinishReason.ABORT, str(exc), failure=p.Failure.REJECTED)]
        return []

    def _open_session(self, msg: p.OpenSession) -> list[p.FromWorker]:
        try:
            self.engine.open_session(msg.session_id, msg.capacity_tokens, msg.idle_timeout_s)
        except SessionError as exc:
            return [p.SessionOpened(msg.session_id, str(exc))]
        return [p.SessionOpened(msg.session_id, "")]

    def _close_session(self, msg: p.CloseSession) -> list[p.FromWorker]:
        self.engine.close_session(msg.session_id)
        return []

    def _abort(self, msg: p.Abort) -> list[p.FromWorker]:
        self.abort(msg.request_id)
        return []

    HANDLERS = {p.Generate: _generate, p.OpenSession: _open_session, p.CloseSession: _close_session,
                p.Abort: _abort}

    # ---- the worker contract -----------------------------------------------------------------------
    def fail_request(self, msg: p.AboutRequest, error: str) -> list[p.FromWorker]:
        """A fault while handling `msg` (about one request): release what it holds, tell its client."""
        self.abort(msg.request_id)
        return [p.TokenOutput(msg.request_id, (), p.FinishReason.ABORT, error, failure=p.Failure.INTERNAL)]

    def step(self) -> list[p.FromWorker]:
        return [token_output(out) for out in self.engine.step()]

    def stats(self) -> p.WorkerStats:
        return self.engine.stats(self.role)

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)


class ColocatedWorker(ClientWorker):
    role = WorkerRole.COLOCATED

    def _peer_dead(self, msg: p.PeerDead) -> list[p.FromWorker]:
        return []  # no peers: nothing to do

    HANDLERS = {**ClientWorker.HANDLERS, p.PeerDead: _peer_dead}


class DecodeWorker(ClientWorker):
    role = WorkerRole.DECODE

    def __init__(self, engine: EngineCore):
        """`engine`: built with a `KVReceiver` (`cluster/worker_host/build.py:make_worker`)."""
        assert isinstance(engine.connector, KVReceiver), "a decode worker's engine lands KV through a KVReceiver"
        super().__init__(engine)
        self.receiver: KVReceiver = engine.connector

    # ---- the messages ------------------------------------------------------------------------------
    def _reserve(self, msg: p.Reserve) -> list[p.FromWorker]:
        try:
            landing = self.receiver.reserve(msg.request_id, list(msg.prompt_token_ids), msg.params, msg.peer)
        except ValueError as exc:
            return [p.Reserved(msg.request_id, None, str(exc))]
        return [p.Reserved(msg.request_id, landing, "")]

    def _from_prefill(self, msg: p.KVProgress | p.KVComplete | p.TransferAborted) -> list[p.FromWorker]:
        self.receiver.on_message(msg)
        return []

    def _peer_dead(self, msg: p.PeerDead) -> list[p.FromWorker]:
        self.receiver.peer_dead(msg.peer)
        return []

    HANDLERS = {**ClientWorker.HANDLERS, p.Reserve: _reserve, p.KVProgress: _from_prefill,
                p.KVComplete: _from_prefill, p.TransferAborted: _from_prefill, p.PeerDead: _peer_dead}

    def _reserve_failed(self, msg: p.Reserve, error: str) -> list[p.FromWorker]:
        """The dispatcher also waits for the answer to a reservation."""
        return [*self.fail_request(msg, error), p.Reserved(msg.request_id, None, error)]

    FAULTS = {p.Reserve: _reserve_failed}

    # ---- the worker contract -----------------------------------------------------------------------
    def step(self) -> list[p.FromWorker]:
        out = super().step()
        out += [msg for _, msg in self.receiver.outbox]  # the dispatcher knows each transfer's peer
        self.receiver.outbox.clear()
        return out

    def stats(self) -> p.WorkerStats:
        return self.engine.stats(self.role, self.receiver.landing.pool, len(self.receiver.inbound))

    def wait_s(self) -> float:
        """Landings only (the peer's messages move them and wake the loop): up to the nearest
        deadline, at most `LANDING_WAIT_S`. Polling them at the loop's busy rate instead cost the loop
        a large share of a core, which slowed a prefill beside it (docs/results.md#cpu-threads)."""
        if not self.receiver.only_landings() or self.engine.housekeeping_due():
            return super().wait_s()
        return max(super().wait_s(), min(LANDING_WAIT_S, self.receiver.next_deadline_s()))

    def max_request_tokens(self) -> int:
        """The context limit and the device pool: not the landing, since a prompt longer than it is
        prefilled here (`router.policy.choose`)."""
        return self.engine.max_request_tokens()

    def abort(self, request_id: str) -> bool:
        return self.receiver.abort(request_id) or self.engine.abort(request_id)
