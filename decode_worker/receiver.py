"""The decode side of the connector: landings in the landing pool, loads to device, then the batch.

Per inbound request (docs/design.md §2 steps 3-6):

    reserve() -> LANDING --KVComplete--> LOAD_PENDING --device pages--> LOADING --event--> batch
                    |  deadline / abort: send AbortTransfer, end the request now
                    v
                 ABANDONING --TransferAborted or peer dead--> landing released

Landing pages stay IN_FLIGHT (a remote writer may still write them) until the prefill worker
reports the transfer ended or is declared dead; only then do they go through the release path.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from common import chaos
from common.config import SamplingParams
from common.faults import internal_error
from common.protocol import AbortTransfer, Failure, KVComplete, KVProgress, Landing, TransferAborted
from decode_worker.rank_landing import OtherLandings
from engine.connector import ConnectorPorts, NullConnector
from engine.output import StepOutput, step_output
from engine.request import FinishReason, Request, RequestStatus, prefill_marks
from kv_store.copier import CopyJob
from kv_store.kv_manager import ReleaseReason, ReqKV
from kv_store.landing import LandingPool
from kv_store.residency import Residency, move_residency
from kv_store.transfer.base import Transport
from kv_store.transfer.page_digest import PageDigest
from kv_store.transfer.session import FailureReason, TransferDeadlines, TransferSession, TransferState

log = logging.getLogger("tandem.decode")


class InboundPhase(enum.Enum):
    LANDING = "landing"  # the prefill worker may be writing the landing
    ABANDONING = "abandoning"  # we gave up; waiting until no write can arrive
    LOAD_PENDING = "load_pending"  # KV complete on the host; waiting for device pages
    LOADING = "loading"  # host -> device copy in flight


@dataclass(eq=False)
class _Inbound:
    request: Request
    landing: Landing
    peer: str
    session: TransferSession
    phase: InboundPhase = InboundPhase.LANDING
    residency: Residency = Residency.HOST
    landed_kv: ReqKV | None = None  # set once the landing is back in our hands
    device_kv: ReqKV | None = None
    load: CopyJob | None = None
    abort_requested: bool = False  # a load cannot be cancelled: the request ends when it lands

    def move(self, dst: InboundPhase) -> None:
        """The only way `phase` changes: a move the diagram in the module docstring does not have raises."""
        if dst not in _INBOUND_MOVES[self.phase]:
            raise RuntimeError(f"request {self.request.request_id}: inbound {self.phase.value} -> {dst.value} "
                               "is not a legal move")
        self.phase = dst

    def landed(self) -> ReqKV:
        """`landed_kv`, for a request whose landing is back in our hands (LOAD_PENDING, LOADING)."""
        assert self.landed_kv is not None, \
            f"request {self.request.request_id} ({self.phase.value}) has no landed KV: used before its KVComplete?"
        return self.landed_kv

    def on_device(self) -> ReqKV:
        """`device_kv`, for a request whose device pages are open (LOADING)."""
        assert self.device_kv is not None, \
            f"request {self.request.request_id} ({self.phase.value}) has no device KV: used before `_start_load`?"
        return self.device_kv


_INBOUND_MOVES = {InboundPhase.LANDING: {InboundPhase.ABANDONING, InboundPhase.LOAD_PENDING},
                  InboundPhase.LOAD_PENDING: {InboundPhase.LOADING}, InboundPhase.LOADING: set(),
                  InboundPhase.ABANDONING: set()}


class KVReceiver(NullConnector):
    """`KVConnector` of a decode worker (the hooks it does not define are NullConnector's no-ops).
    Messages for prefill workers accumulate in `outbox` as (peer, message)."""

    def __init__(self, ports: ConnectorPorts, transport: Transport, host_pages: int,
                 deadlines: TransferDeadlines = TransferDeadlines(), clock: Callable[[], float] = time.monotonic,
                 others: Callable[[], OtherLandings] | None = None):
        """`ports`: what the engine lends (`EngineCore` makes the receiver with them); a landing pool of
        `host_pages` pages is made here and registered with `transport`. Rank 0 of an engine over
        ranks: `others` makes the other ranks' side of its landings (`rank_landing.py`), once its own is."""
        self.ports, self.kv = ports, ports.kv
        self.transport, self.deadlines, self.clock = transport, deadlines, clock
        self.inbound: dict[str, _Inbound] = {}
        self.outbox: list[tuple[str, AbortTransfer]] = []
        self._pending_outputs: list[StepOutput] = []
        self._arrived: list[tuple[Request, ReqKV]] = []
        self._regions = contextlib.ExitStack()
        self.landing = LandingPool(ports.device_pool, host_pages)
        self._digest, self.checksum_failures, self.verified_pages = PageDigest(self.landing.kv), 0, 0
        for t in (*self.landing.kv.k, *self.landing.kv.v):
            self._regions.enter_context(self.transport.register_tensor(t))
        self.others = others() if others is not None else None

    # ---- the worker's requests ---------------------------------------------------------------------
    def reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                peer: str) -> Landing | None:
        """Reserve host pages for the prompt's KV; None when the landing pool is full (try later).
        Raises ValueError for a request that can never fit, or whose id is in use, like `add_request`."""
        if request_id in self.inbound:
            raise ValueError(f"request id {request_id!r} is already in use")
        req = self.ports.new_request(prompt_token_ids, params, request_id)
        landing = self.landing.reserve(request_id, len(prompt_token_ids), self.transport.session_id,
                                    self.deadlines.waiting_s + self.deadlines.transferring_s)
        if landing is None:
            return None
        if self.others is not None:
            landing = self.others.spread(landing)
        session = TransferSession(request_id, self.deadlines, self.clock())
        session.advance(TransferState.WAITING, self.clock())
        req.timings["reserved"] = self.clock()
        self.inbound[request_id] = _Inbound(req, landing, peer, session)
        return landing

    def on_message(self, msg: KVProgress | KVComplete | TransferAborted) -> None:
        """A prefill worker's word about an inbound request (relayed by the dispatcher), by its kind
        (`_ON_MESSAGE`); a late one, for a request already ended, is dropped."""
        ib = self.inbound.get(msg.request_id)
        if ib is None:
            return
        on_message = _ON_MESSAGE.get(type(msg))
        if on_message is None:
            raise TypeError(f"a KV receiver cannot handle {type(msg).__name__}")
        on_message(self, ib, msg)

    def peer_dead(self, peer: str) -> None:
        """Nothing more can arrive from `peer`: its landings are ours again."""
        for ib in list(self.inbound.values()):
            if ib.peer == peer and ib.phase in (InboundPhase.LANDING, InboundPhase.ABANDONING):
                self._landing_free(ib, FailureReason.PEER_DEAD, f"prefill worker {peer} stopped responding")

    def abort(self, request_id: str) -> bool:
        """End an inbound request (False: it is not inbound here)."""
        ib = self.inbound.get(request_id)
        if ib is None:
            return False
        if ib.phase is InboundPhase.LANDING:
            self._give_up(ib, FailureReason.ABORTED, "aborted by the client")
        elif ib.phase is InboundPhase.LOAD_PENDING:
            self._end_inbound(ib, FinishReason.ABORT)
        elif ib.phase is InboundPhase.LOADING:
            ib.abort_requested = True
        return True

    # ---- KVConnector -------------------------------------------------------------------------------
    def before_step(self) -> list[StepOutput]:
        """Deadlines, loads to start, loads that landed: each request's transition confined to it (a
        fault fails that request alone, `_fail_inbound`)."""
        now = self.clock()
        for ib in list(self.inbound.values()):
            if ib.phase is InboundPhase.LANDING:
                self._confined(ib, self._check_deadline, ib, now)
        for ib in [ib for ib in self.inbound.values() if ib.phase is InboundPhase.LOAD_PENDING]:
            self._confined(ib, self._start_load, ib)
        for request_id, job in self.landing.poll_loads():
            ib = self.inbound[request_id]
            self._confined(ib, self._loaded, ib, job)
        outputs, self._pending_outputs = self._pending_outputs, []
        return outputs

    def take_arrived(self) -> list[tuple[Request, ReqKV]]:
        arrived, self._arrived = self._arrived, []
        return arrived

    def busy(self) -> bool:
        return bool(self.inbound or self._pending_outputs or self.outbox)

    def only_landings(self) -> bool:
        """Whether every inbound request waits for its peer's word (landing or abandoning), with
        nothing else to hand over: only a message (or a deadline) can move one."""
        return not self._pending_outputs and not self.outbox and all(
            ib.phase in (InboundPhase.LANDING, InboundPhase.ABANDONING) for ib in self.inbound.values())

    def next_deadline_s(self) -> float:
        """Seconds to the nearest landing's deadline (inf: none)."""
        now = self.clock()
        return min((ib.session.deadline - now for ib in self.inbound.values() if ib.phase is InboundPhase.LANDING),
                   default=float("inf"))

    def check_integrity(self) -> None:
        self.landing.check_integrity()

    def close(self) -> None:
        self._regions.close()
        self.landing.close()

    # ---- faults ------------------------------------------------------------------------------------
    def _confined(self, ib: _Inbound, transition: Callable[..., object], *args: object) -> None:
        try:
            transition(*args)
        except Exception as exc:  # noqa: BLE001 - this request's fault: end it, keep the others going
            self._fail_inbound(ib, internal_error(ib.request.request_id, exc, transition.__name__))
            self.ports.check_integrity()  # what it held went back cleanly, or the worker must stop
            self.check_integrity()

    def _fail_inbound(self, ib: _Inbound, error: str) -> None:
        """End `ib`'s request with an internal error, releasing what it holds now or once it can be."""
        rid = ib.request.request_id
        if ib.phase is InboundPhase.LANDING:  # the peer may still write: the landing waits for its word
            ib.session.fail(FailureReason.ABORTED, error) if not ib.session.terminal else None
            ib.move(InboundPhase.ABANDONING)
            self.outbox.append((ib.peer, AbortTransfer(rid, error)))
        elif self.landing.loading(ib.load):
            ib.abort_requested = True  # a load cannot be cancelled: `_loaded` releases it when it lands
        elif self.inbound.pop(rid, None) is not None:  # landed: what it holds is its own (release is idempotent)
            if ib.device_kv is not None:
                self.kv.release_kv(ib.device_kv, ReleaseReason.ABORTED, None)
            self.landing.release(ib.landed(), ReleaseReason.ABORTED)
        if ib.request.status is not RequestStatus.FINISHED:
            ib.request.error = error
            ib.request.finish(FinishReason.ABORT)
            self._pending_outputs.append(step_output(ib.request, [], FinishReason.ABORT, error, Failure.INTERNAL))

    # ---- inbound transitions -----------------------------------------------------------------------
    def _check_deadline(self, ib: _Inbound, now: float) -> None:
        if ib.session.check_deadline(now):
            self._give_up(ib, FailureReason.TIMEOUT, ib.session.failure_detail)

    def _kv_progress(self, ib: _Inbound, msg: KVProgress) -> None:
        if ib.phase is not InboundPhase.LANDING:
            return
        if ib.session.state is TransferState.WAITING:
            ib.session.advance(TransferState.TRANSFERRING, self.clock())
        else:
            ib.session.progress(self.clock())

    def _kv_complete(self, ib: _Inbound, msg: KVComplete) -> None:
        ib.request.spec.feature = msg.draft_feature
        if ib.phase is not InboundPhase.LANDING:
            self._landing_free(ib, ib.session.failure or FailureReason.ABORTED, ib.session.failure_detail)
            return
        if ib.session.state is TransferState.WAITING:
            ib.session.advance(TransferState.TRANSFERRING, self.clock())
        ib.session.advance(TransferState.DONE, self.clock())
        ib.landed_kv = self.landing.landed(ib.request.request_id)
        if not self._sums_match(ib, msg.page_sums):
            return
        req = ib.request
        req.cached_tokens = msg.cached_tokens
        _, host, l3 = msg.cached_tiers
        req.tier.host_hit_tokens, req.tier.l3_hit_tokens = host + l3, l3
        req.timings.update(prefill_marks(msg.timings))
        req.timings["kv_complete_received"] = self.clock()
        reason = self.ports.first_token(req, msg.first_token, msg.first_logprobs, msg.prompt_logprobs)
        ib.move(InboundPhase.LOAD_PENDING)
        if reason is not None:
            self._end_inbound(ib, reason)
        else:
            self._pending_outputs.append(step_output(req, [msg.first_token], None))

    def _transfer_aborted(self, ib: _Inbound, msg: TransferAborted) -> None:
        self._landing_free(ib, FailureReason.TRANSPORT_ERROR, f"prefill worker aborted: {msg.reason}", msg)

    def _sums_match(self, ib: _Inbound, sums: tuple[int, ...]) -> bool:
        """Whether every landed page has the checksum its prefill worker shipped it with (over ranks:
        each rank's part of it, `sums` shard-major); if not, the landing is let go and the request
        fails as a failed transfer (re-routed: computed again), before its first token goes out."""
        num_pages = len(sums) // (1 if self.others is None else 1 + len(self.others.shards))
        pages = list(ib.landed().pages[:num_pages])
        if pages and chaos.strike("landing"):
            self._digest.damage(pages[0])
        got = self._digest.digests(pages) + (self.others.digests(pages) if self.others is not None and pages else [])
        bad = sorted({i % num_pages for i, (mine, sent) in enumerate(zip(got, sums)) if mine != sent})
        if len(got) != len(sums):  # a rank that could not digest its part: nothing to vouch for it
            bad = list(range(num_pages))
        self.verified_pages += num_pages
        if not bad:
            return True
        self.checksum_failures += 1
        detail = f"landed KV page(s) {bad} of {num_pages} failed their checksum"
        log.error("request %s: %s; the landing is dropped and the prompt computed again", ib.request.request_id, detail)
        self.landing.release(ib.landed(), ReleaseReason.TRANSFER_FAILED)
        del self.inbound[ib.request.request_id]
        self._report(ib.request, FinishReason.ABORT, f"transfer corrupt: {detail}", Failure.CORRUPT)
        return False

    def _start_load(self, ib: _Inbound) -> None:
        req = ib.request
        kv = self.kv.open_for_load(req.request_id, len(req.prompt_token_ids))
        if kv is None:
            return  # no room yet: retry next step
        ib.device_kv = kv
        ib.move(InboundPhase.LOADING)
        ib.residency = move_residency(ib.residency, Residency.LOADING, req.request_id)
        req.timings["load_start"] = self.clock()
        if self.others is not None:  # their copies end before this returns (a failure fails the request)
            self.others.load(list(ib.landed().pages), list(kv.pages))
        ib.load = self.landing.start_load(ib.landed(), kv)

    def _loaded(self, ib: _Inbound, job: CopyJob) -> None:
        """The KV is on the device: the request joins the batch (or ends, when aborted while loading).
        A copy that failed fails the request (`_confined`), both its pools' pages released."""
        if job.error is not None:
            raise RuntimeError(f"the landing -> device copy failed: {job.error!r}")
        req = ib.request
        req.timings["load_done"] = self.clock()
        ib.residency = move_residency(ib.residency, Residency.BOTH, req.request_id)
        self.kv.commit_loaded(ib.on_device(), len(req.prompt_token_ids))
        self.landing.release(ib.landed(), ReleaseReason.FINISHED)
        ib.residency = move_residency(ib.residency, Residency.DEVICE, req.request_id)
        del self.inbound[req.request_id]
        if ib.abort_requested:  # its client is gone (or it failed): end it, no output
            self.kv.release_kv(ib.on_device(), ReleaseReason.ABORTED, req.all_token_ids)
            if req.status is not RequestStatus.FINISHED:
                req.finish(FinishReason.ABORT)
        else:
            self._arrived.append((req, ib.on_device()))

    def _give_up(self, ib: _Inbound, reason: FailureReason, detail: str) -> None:
        """Stop waiting for the transfer: tell the peer, end the request now; the landing stays
        IN_FLIGHT until the peer confirms or is declared dead."""
        ib.session.fail(reason, detail)
        ib.move(InboundPhase.ABANDONING)
        self.outbox.append((ib.peer, AbortTransfer(ib.request.request_id, detail or reason.value)))
        self._report(ib.request, FinishReason.ABORT, f"transfer {reason.value}: {detail}", Failure.TRANSFER)

    def _landing_free(self, ib: _Inbound, reason: FailureReason, detail: str,
                      aborted: TransferAborted | None = None) -> None:
        """No write to the landing is outstanding any more: release it; end the request if still open
        (with the prefill worker's own error when a fault of the request's ended it there)."""
        if ib.phase is InboundPhase.LANDING:
            ib.session.fail(reason, detail)
            if aborted is not None and aborted.failure is not Failure.TRANSFER:
                self._report(ib.request, FinishReason.ABORT, aborted.reason, aborted.failure)
            else:
                self._report(ib.request, FinishReason.ABORT, f"transfer {reason.value}: {detail}", Failure.TRANSFER)
        self.landing.release(self.landing.abandon(ib.request.request_id), ReleaseReason.TRANSFER_FAILED)
        del self.inbound[ib.request.request_id]

    def _end_inbound(self, ib: _Inbound, reason: FinishReason) -> None:
        """End a request whose KV is on the host only (first token finished it, or aborted)."""
        self.landing.release(ib.landed(), ReleaseReason.FINISHED if reason is not FinishReason.ABORT
                          else ReleaseReason.ABORTED)
        del self.inbound[ib.request.request_id]
        self._report(ib.request, reason, "")

    def _report(self, req: Request, reason: FinishReason, error: str, failure: Failure | None = None) -> None:
        """End a request that never joined the batch. Its only token (if any) is the first one."""
        req.error = error
        req.finish(reason)
        tokens = list(req.output_token_ids) if not error else []
        self._pending_outputs.append(step_output(req, tokens, reason, error, failure))


_ON_MESSAGE: dict[type, Callable[[KVReceiver, _Inbound, Any], None]] = {
    KVProgress: KVReceiver._kv_progress, KVComplete: KVReceiver._kv_complete,
    TransferAborted: KVReceiver._transfer_aborted}
"""A prefill worker's message kind -> the receiver's transition for it."""
