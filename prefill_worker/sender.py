"""The prefill side of the connector: ship each step's KV to a decode worker's landing.

After every step, each request's newly completed pages are written to its landing through the
transport (one write per chunk); its own pages are IN_FLIGHT under that write's handle until the
handle completes. When the prompt is done the first token is sampled, the request leaves the batch
but keeps its KV until every handle has retired, then the decode worker gets `KVComplete` and the
KV goes through the release path (into this worker's prefix cache).

Failure (transport error, deadline, abort from the decode side, dead peer) stops new writes at
once; the request is released when its last outstanding write is terminal, and the decode worker
gets `TransferAborted` — its promise that nothing more will be written to that landing.

Where the transport cannot read the KV pool in place (a GPU pool and a transport that copies from
host memory: `staging.reads_in_place`), pages go through staging (`prefill_worker/staging.py`): a
copy device -> staging pages first (the request's device pages pinned under the copy job until it is
done), then the write from the staging pages, which are free again when that write retires. A request
whose pages do not all fit the staging pages ships them in pieces, as pages free up.

Over tensor-parallel ranks (on either side) a write is one transfer per rank pair holding the same
heads, each from the prefill rank that holds them (`rank_writes.py`), under one handle.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common.faults import internal_error
from common.protocol import Failure, KVComplete, KVProgress, Landing, TransferAborted
from engine.connector import ConnectorPorts, NullConnector
from engine.output import StepOutput
from engine.request import FinishReason, Request, RequestStatus
from kv_store.copier import CopyJob
from kv_store.kv_manager import ceil_div
from kv_store.stream_order import order_for
from kv_store.transfer.base import TransferError, TransferStatus, Transport
from kv_store.transfer.heads import SourceKV, sent_heads
from kv_store.transfer.page_digest import PageDigest, PartialSums
from kv_store.transfer.session import FailureReason, TransferDeadlines, TransferSession, TransferState
from prefill_worker.rank_writes import OtherRanks, ShardWrites
from prefill_worker.staging import StagingPages, reads_in_place

if TYPE_CHECKING:
    from engine.scheduler import ScheduledStep


@dataclass(eq=False)
class _Staged:
    """Pages [start, stop) of a request being copied into `staging_pages` by `job` (which pins the
    device pages it reads), written from there once the copy is done."""

    job: CopyJob
    start: int
    stop: int
    staging_pages: list[int]


@dataclass(eq=False)
class _Shipment:
    """One request's KV on its way out. `handles`: its writes not yet retired, each pinning the
    pages it reads (`KVManager.pin_for_transfer`)."""

    request: Request
    landing: Landing
    session: TransferSession
    sums: PartialSums  # the landing pages' digests, added up as each rank writes its part
    pages_sent: int = 0
    handles: set = field(default_factory=set)
    first_token: int | None = None  # set when the prompt is done and the token sampled
    draft_feature: bytes = b""  # with EAGLE: the head's feature at the prompt's last position
    abort_reason: str | None = None  # set when the transfer is being abandoned
    failure: Failure = Failure.TRANSFER  # with abort_reason: INTERNAL when a fault of the request's own ended it
    bytes_sent: int = 0
    pages_at_handle: dict = field(default_factory=dict)  # handle -> pages written once it retires
    pages_done: int = 0
    copies: list[_Staged] = field(default_factory=list)  # staged only: copies not yet written, in order
    deferred: bool = False  # staged only: completed pages staging had no room for yet


class KVSender(NullConnector):
    """`KVConnector` of a prefill worker (the hooks it does not define are NullConnector's no-ops).
    Messages for the decode worker accumulate in `outbox`
    (KVProgress, KVComplete, TransferAborted) for the worker's loop to deliver."""

    def __init__(self, ports: ConnectorPorts, transport: Transport, deadlines: TransferDeadlines = TransferDeadlines(),
                 clock: Callable[[], float] = time.monotonic, staging_pages: int = 64,
                 others: OtherRanks | None = None):
        """`ports`: what the engine lends (`EngineCore` makes the sender with them); its KV tensors are
        registered with `transport` here, or, where the transport cannot read them in place, this
        many `staging_pages` (module docstring). Rank 0 of an engine over ranks: `others`, the other
        ranks' writes (`rank_writes.py`)."""
        self.ports, self.kv, self.kv_cache = ports, ports.kv, ports.kv_cache
        self.transport, self.deadlines, self.clock = transport, deadlines, clock
        self.shipments: dict[str, _Shipment] = {}
        self.outbox: list[KVComplete | KVProgress | TransferAborted] = []
        self._regions = contextlib.ExitStack()
        self._done: list[tuple[Request, FinishReason]] = []
        self._stopped: list[Request] = []
        self._staging_at_handle: dict[object, list[int]] = {}  # staged writes: handle -> the pages it reads
        self._order = order_for(self.kv_cache.k[0].device)
        self.staging = None if reads_in_place(self.kv_cache, transport) else StagingPages(self.kv_cache, staging_pages)
        if others is not None and self.staging is not None:
            raise TransferError("a prefill worker over tensor-parallel ranks ships from its device pools in place: it "
                                "needs a transport that reads device memory (install the `gpu` extra's Mooncake)")
        shipped_from = self.kv_cache if self.staging is None else self.staging.kv
        for t in (*shipped_from.k, *shipped_from.v):
            self._regions.enter_context(self.transport.register_tensor(t))
        self.writes = ShardWrites(transport, others)
        # each landing page's digest for the decode side to verify, computed where the transport reads it
        # (a device pool read in place: on its device), each rank its heads' part (`page_digest.py`)
        self._sums = PageDigest(shipped_from)
        heads = () if others is None else (others.held[0], sent_heads(others.held, 0))
        self._source = SourceKV.of(shipped_from, *heads)
        self._ranks = 1 if others is None else others.size
        layout = ports.device_pool.layout  # landings are laid out for the whole model's heads
        self.layout = layout if others is None else dataclasses.replace(layout, num_kv_heads=others.num_kv_heads)

    # ---- the worker's requests ---------------------------------------------------------------------
    def open(self, req: Request, landing: Landing) -> None:
        """Ship `req`'s KV (queued in the engine) into `landing`."""
        req.timings["prefill_submitted"] = self.clock()
        session = TransferSession(req.request_id, self.deadlines, self.clock())
        session.advance(TransferState.WAITING, self.clock())
        self.shipments[req.request_id] = _Shipment(req, landing, session, sums=PartialSums(self._ranks))

    def abort_transfer(self, request_id: str, reason: FailureReason, detail: str = "",
                       failure: Failure = Failure.TRANSFER) -> None:
        """Stop shipping `request_id`: no new writes; the engine ends the request at its next
        `take_stopped` (taking it out of the batch), and its KV is released once outstanding writes
        are terminal. `failure`: INTERNAL when a fault of the request's own ends it (its client is
        not re-routed)."""
        shipment = self.shipments.get(request_id)
        if shipment is None:  # never got it (aborted before it arrived) or done: nothing will be written
            self.outbox.append(TransferAborted(request_id, detail or f"no transfer in progress ({reason.value})",
                                               failure))
            return
        if shipment.abort_reason is not None:
            return
        shipment.session.fail(reason, detail) if not shipment.session.terminal else None
        shipment.abort_reason = detail if failure else f"{reason.value}: {detail}" if detail else reason.value
        shipment.failure = failure
        self._stopped.append(shipment.request)

    def peer_dead(self, session: str) -> None:
        for rid, shipment in list(self.shipments.items()):
            if shipment.landing.session == session:
                self.abort_transfer(rid, FailureReason.PEER_DEAD, f"decode worker {session} stopped responding")

    # ---- KVConnector -------------------------------------------------------------------------------
    def take_stopped(self) -> list[Request]:
        stopped, self._stopped = self._stopped, []
        return stopped

    def before_step(self) -> list[StepOutput]:
        """Writes that ended, staged copies that ended (written now) and pages staging had no room
        for (staged now), and deadlines; each shipment's work confined to it (a fault aborts that
        transfer alone)."""
        now = self.clock()
        self.writes.refresh()
        for rid, shipment in list(self.shipments.items()):
            self._confined(rid, self._poll_writes, rid, shipment, now)
            if self.staging is not None:
                self._confined(rid, self._poll_copies, shipment)
                if shipment.deferred and shipment.abort_reason is None and shipment.request.kv is not None:
                    self._confined(rid, self._ship, shipment.request, shipment)
        for rid, shipment in list(self.shipments.items()):
            self._confined(rid, self._check_deadline, rid, shipment, now)
        return []

    def after_commit(self, step: ScheduledStep) -> None:
        for req in step.requests:
            shipment = self.shipments.get(req.request_id)
            if shipment is not None and shipment.abort_reason is None:
                self._confined(req.request_id, self._ship, req, shipment)

    def request_finished(self, req: Request, reason: FinishReason) -> bool:
        """The first token is sampled: hold the KV until every write has retired. A request with
        nothing to ship (an answer's prefill, `PrefillWorker.prefill_answer`) is released at once."""
        shipment = self.shipments.get(req.request_id)
        if shipment is None:
            return False
        if shipment.abort_reason is None:  # an abort during this step already took it out of the batch
            shipment.first_token = req.output_token_ids[-1]
            shipment.draft_feature = self.ports.export_feature(req.request_id)
            req.timings["compute_done"] = self.clock()
        return True

    def request_failed(self, req: Request, error: str, failure: Failure = Failure.INTERNAL) -> bool:
        """A fault of its own ends the transfer: the decode worker hears `TransferAborted`, and the KV
        is released once no write reads it. A request with nothing to ship is released at once."""
        if req.request_id not in self.shipments:
            return False
        self.abort_transfer(req.request_id, FailureReason.ABORTED, error, failure)
        return True

    def take_finished(self) -> list[tuple[Request, FinishReason]]:
        self._retire_finished()
        done, self._done = self._done, []
        return done

    def busy(self) -> bool:
        return bool(self.shipments or self.outbox)

    def close(self) -> None:
        self._regions.close()
        if self.staging is not None:
            self.staging.close()

    def check_integrity(self) -> None:
        """The staging pages (if any): each free or lent to exactly one copy or write in flight."""
        if self.staging is None:
            return
        self.staging.check_integrity()
        lent = [p for s in self.shipments.values() for c in s.copies for p in c.staging_pages]
        lent += [p for pages in self._staging_at_handle.values() for p in pages]
        assert len(lent) == len(set(lent)), "a staging page is lent to two copies or writes"
        assert len(lent) + self.staging.num_free == self.staging.num_pages, (
            f"{self.staging.num_pages - self.staging.num_free} staging pages lent, {len(lent)} held by copies and "
            "writes in flight: one leaked (a write retired without giving its pages back?)")

    # ---- faults ------------------------------------------------------------------------------------
    def _confined(self, request_id: str, work: Callable[..., object], *args: object) -> None:
        try:
            work(*args)
        except Exception as exc:  # noqa: BLE001 - this transfer's fault: abort it, keep the others going
            self.abort_transfer(request_id, FailureReason.ABORTED, internal_error(request_id, exc, work.__name__),
                                Failure.INTERNAL)
            self.ports.check_integrity()  # nothing was left half-owned, or the worker must stop

    def _check_deadline(self, request_id: str, shipment: _Shipment, now: float) -> None:
        if shipment.session.check_deadline(now):
            self.abort_transfer(request_id, FailureReason.TIMEOUT, shipment.session.failure_detail)

    # ---- shipping ----------------------------------------------------------------------------------
    def _ship(self, req: Request, shipment: _Shipment) -> None:
        """Write the pages completed since the last call (all remaining ones once the prompt is done);
        through staging, copy as many of them as staging has room for."""
        kv, ps = req.held_kv(), self.ports.page_size
        prompt_len = len(req.prompt_token_ids)
        done = kv.kv_committed_len >= prompt_len
        upto = ceil_div(prompt_len, ps) if done else kv.kv_committed_len // ps
        if upto <= shipment.pages_sent:
            return
        start = shipment.pages_sent
        if self.staging is not None:
            self._stage(req, shipment, start, upto)
            return
        # A transport reading GPU memory in place does so outside CUDA's streams: the forward that
        # wrote these pages must be done first (on a CPU this waits for nothing).
        self._order.host_wait(self._order.mark())
        # The write reads cached pages too: a retract or abort may drop the request's tree lock
        # long before this handle retires, so the handle pins all it reads, whoever owns it.
        handle = self._write(shipment, kv.pages[start:upto], start, upto)
        if handle is not None:
            shipment.handles.add(self.kv.pin_for_transfer(kv, start, upto, handle))

    def _stage(self, req: Request, shipment: _Shipment, start: int, upto: int) -> None:
        """Copy pages [start, upto) of `req`, as many as staging has free, into staging; the copy job
        pins the device pages until it is done. The write follows the copy (`_poll_copies`)."""
        staging, kv = self._staged(), req.held_kv()
        staging_pages = staging.take(upto - start)
        stop = start + len(staging_pages)
        shipment.deferred = stop < upto  # staging full: `before_step` tries again as writes retire
        if not staging_pages:
            return
        job = staging.copy_in(kv.pages[start:stop], staging_pages)
        self.kv.pin_for_transfer(kv, start, stop, job)
        shipment.copies.append(_Staged(job, start, stop, staging_pages))
        shipment.pages_sent = stop
        self._poll_copies(shipment)  # a CPU copier is done already

    def _staged(self) -> StagingPages:
        assert self.staging is not None, "staging pages handled by a sender that writes in place (no staging)"
        return self.staging

    def _poll_copies(self, shipment: _Shipment) -> None:
        """Copies that are done, in order: the device pages go back; the staging pages are written
        (or, when the copy failed or the transfer is being abandoned, given back)."""
        while shipment.copies and shipment.copies[0].job.done():
            staged = shipment.copies.pop(0)
            self.kv.unpin_transfer(staged.job)
            if staged.job.error is not None:
                self._staged().give_back(staged.staging_pages)
                self.abort_transfer(shipment.request.request_id, FailureReason.TRANSPORT_ERROR,
                                    f"copying pages to host staging failed: {staged.job.error!r}")
                continue
            if shipment.abort_reason is not None:
                self._staged().give_back(staged.staging_pages)
                continue
            handle = self._write(shipment, staged.staging_pages, staged.start, staged.stop)
            if handle is None:
                self._staged().give_back(staged.staging_pages)
                continue
            shipment.handles.add(handle)
            self._staging_at_handle[handle] = staged.staging_pages

    def _write(self, shipment: _Shipment, src_pages: list[int], start: int, stop: int) -> object | None:
        """Write `src_pages` of the pool shipped from (the request's pages [start, stop)) to its
        landing; the handle, or None when the transport refused it (the transfer is aborted then)."""
        try:
            handle = self.writes.write(self._source, shipment.landing, src_pages, start)
        except TransferError as exc:
            self.abort_transfer(shipment.request.request_id, FailureReason.TRANSPORT_ERROR, str(exc))
            return None
        shards = [shard.heads for shard in shipment.landing.all_shards()]  # what the transport reads, digested
        shipment.sums.add(start, self._sums.shard_sums(src_pages, self._source.held, self._source.sent, shards))
        shipment.pages_at_handle[handle] = stop
        shipment.pages_sent = max(shipment.pages_sent, stop)
        if shipment.session.state is TransferState.WAITING:
            shipment.session.advance(TransferState.TRANSFERRING, self.clock())
            shipment.request.timings["first_write"] = self.clock()
        shipment.bytes_sent += handle.num_bytes
        return handle

    def _poll_writes(self, rid: str, shipment: _Shipment, now: float) -> None:
        for handle in list(shipment.handles):
            status = self.writes.poll(handle)
            if status is TransferStatus.PENDING:
                continue
            if status is TransferStatus.FAILED:
                self.abort_transfer(rid, FailureReason.TRANSPORT_ERROR, str(self.writes.error(handle)))
                if not self.writes.settled(handle):
                    continue  # abandoned batches may still read these pages and write the landing
            if status is TransferStatus.DONE:
                self.writes.add_other_sums(handle, shipment.sums)
            shipment.handles.discard(handle)
            self.writes.retire(handle)
            staging_pages = self._staging_at_handle.pop(handle, None)
            if staging_pages is None:
                self.kv.unpin_transfer(handle)  # terminal and settled: nothing reads its pages now
            else:
                self._staged().give_back(staging_pages)
            if status is TransferStatus.DONE and shipment.session.state is TransferState.TRANSFERRING:
                shipment.session.progress(now)
                shipment.pages_done = max(shipment.pages_done, shipment.pages_at_handle.pop(handle, 0))
                if shipment.first_token is None:  # once the prompt is done, KVComplete follows shortly
                    self.outbox.append(KVProgress(rid, shipment.pages_done))

    def _retire_finished(self) -> None:
        """Hand back every request whose outstanding writes are all terminal and whose fate is known."""
        for rid, shipment in list(self.shipments.items()):
            if shipment.handles or shipment.copies or (shipment.abort_reason is None and shipment.first_token is None):
                continue
            req = shipment.request
            if shipment.abort_reason is None and shipment.pages_sent < ceil_div(len(req.prompt_token_ids),
                                                                                self.ports.page_size):
                continue  # staging had no room for the last pages yet
            if shipment.abort_reason is None:
                assert shipment.first_token is not None, f"request {rid}'s transfer done without its first token"
                shipment.session.advance(TransferState.DONE, self.clock())
                req.timings["transfer_done"] = self.clock()
                first, prompt = first_logprobs(req)
                self.outbox.append(KVComplete(rid, shipment.first_token, req.cached_tokens, tuple(req.timings.items()),
                                              shipment.draft_feature, first, req.cached_tiers, prompt,
                                              shipment.sums.digests(len(shipment.landing.page_ids))))
                self._done.append((req, FinishReason.LENGTH))
            else:
                self.outbox.append(TransferAborted(rid, shipment.abort_reason, shipment.failure))
                if req.status is RequestStatus.RUNNING:  # out of the batch, its KV held here
                    self._done.append((req, FinishReason.ABORT))
            del self.shipments[rid]


def first_logprobs(req: Request) -> tuple:
    """(the first token's logprobs or None, the prompt's) as `KVComplete` carries them, where asked."""
    first = req.output_logprobs[-1] if req.params.logprobs is not None and req.output_logprobs else None
    return first, tuple(req.prompt_logprobs) if req.params.prompt_logprobs is not None else ()
