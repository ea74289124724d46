"""Prefill worker: chunked prefill with its own radix cache, shipping KV to a decode worker's landing.

After every step, each request's newly completed pages are written to its landing through the
transport (one write per chunk); its own pages are IN_FLIGHT under that write's handle until the
handle completes. When the prompt is done the first token is sampled, the request leaves the batch
but keeps its KV until every handle has retired, then the decode worker gets `KVComplete` and the
KV goes through the release path (into this worker's prefix cache).

Failure (transport error, deadline, abort from the decode side, dead peer) stops new writes at
once; the request is released when its last outstanding write is terminal, and the decode worker
gets `TransferAborted` — its promise that nothing more will be written to that landing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from cluster.config import SamplingParams
from cluster.protocol import AbortTransfer, KVComplete, KVProgress, Landing, TransferAborted
from kv_store.req_kv import ceil_div
from kv_store.transfer.base import TransferError, TransferStatus, Transport, WriteOp, coalesce
from kv_store.transfer.session import FailureReason, TransferDeadlines, TransferSession, TransferState
from prefill_worker.engine_core import EngineCore
from prefill_worker.request import FinishReason, Request, RequestStatus


@dataclass(eq=False)
class _Shipment:
    """One request's KV on its way out. `handles`: its writes not yet retired, each pinning the
    pages it reads (`KVManager.pin_for_transfer`)."""

    landing: Landing
    session: TransferSession
    pages_sent: int = 0
    handles: set = field(default_factory=set)
    first_token: int | None = None  # set when the prompt is done and the token sampled
    abort_reason: str | None = None  # set when the transfer is being abandoned
    bytes_sent: int = 0
    pages_at_handle: dict = field(default_factory=dict)  # handle -> pages written once it retires
    pages_done: int = 0


class PrefillWorker(EngineCore):
    """Not thread-safe: one loop calls `submit`, `on_message` and `step`; messages for the decode
    worker accumulate in `outbox` for that loop to deliver."""

    speaks_for_client = False

    def __init__(self, config, model, arch, transport: Transport, tokenizer=None, eos_token_ids=(),
                 deadlines: TransferDeadlines = TransferDeadlines(), clock: Callable[[], float] = time.monotonic):
        super().__init__(config, model, arch, tokenizer, eos_token_ids)
        self.transport, self.deadlines, self.clock = transport, deadlines, clock
        self._regions = contextlib.ExitStack()
        for t in (*self.kv_cache.k, *self.kv_cache.v):
            self._regions.enter_context(transport.register_tensor(t))
        self.shipments: dict[str, _Shipment] = {}
        self.outbox: list[KVComplete | KVProgress | TransferAborted] = []
        self.scheduler.retractable = self._retractable

    # ---- inputs ------------------------------------------------------------------------------------
    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, landing: Landing) -> None:
        """Prefill `prompt_token_ids` into `landing`. Raises ValueError (holding nothing) on a bad landing."""
        landing.layout.check_compatible(self.device_pool.layout)
        need = ceil_div(len(prompt_token_ids), self.config.page_size)
        if len(landing.page_ids) != need:
            raise ValueError(f"landing for {request_id} has {len(landing.page_ids)} pages, the prompt needs {need}")
        # Prefill samples only the first token; the decode worker applies the stop rules to it.
        req = self.add_request(prompt_token_ids, dataclasses.replace(params, max_tokens=1, stop=()), request_id)
        req.timings["prefill_submitted"] = self.clock()
        session = TransferSession(request_id, self.deadlines, self.clock())
        session.advance(TransferState.WAITING, self.clock())
        self.shipments[request_id] = _Shipment(landing, session)

    def on_message(self, msg: AbortTransfer) -> None:
        if isinstance(msg, AbortTransfer):
            self.abort_transfer(msg.request_id, FailureReason.ABORTED, msg.reason)
        else:
            raise TypeError(f"prefill worker cannot handle {type(msg).__name__}")

    def abort_transfer(self, request_id: str, reason: FailureReason, detail: str = "") -> None:
        """Stop shipping `request_id`: no new writes; released once outstanding writes are terminal."""
        sh = self.shipments.get(request_id)
        if sh is None:  # never got it (aborted before it arrived) or done: nothing will be written
            self.outbox.append(TransferAborted(request_id, f"no transfer in progress ({reason.value})"))
            return
        if sh.abort_reason is not None:
            return
        sh.session.fail(reason, detail) if not sh.session.terminal else None
        sh.abort_reason = f"{reason.value}: {detail}" if detail else reason.value
        req = self.requests.get(request_id)
        if req is not None and req.status is RequestStatus.WAITING:
            self.scheduler.finish(req, FinishReason.ABORT)  # holds no KV yet
            del self.requests[request_id]
        elif req is not None and req in self.scheduler.running:
            self.scheduler.detach(req)

    def peer_dead(self, session: str) -> None:
        for rid, sh in list(self.shipments.items()):
            if sh.landing.session == session:
                self.abort_transfer(rid, FailureReason.PEER_DEAD, f"decode worker {session} stopped responding")

    def fail_request(self, request_id: str, error: str) -> None:
        """A fault of its own ends the transfer: the decode worker hears `TransferAborted`, and the KV
        is released once no write reads it."""
        self.abort_transfer(request_id, FailureReason.ABORTED, error)

    def has_unfinished(self) -> bool:
        return bool(self.shipments) or super().has_unfinished()

    # ---- the loop ----------------------------------------------------------------------------------
    def step(self):
        self._poll_writes()
        now = self.clock()
        for rid, sh in list(self.shipments.items()):
            if sh.session.check_deadline(now):
                self.abort_transfer(rid, FailureReason.TIMEOUT, sh.session.failure_detail)
        outputs = super().step() if self.scheduler.has_work() else []
        self._retire_finished()
        return outputs

    def close(self) -> None:
        self._regions.close()

    # ---- hooks -------------------------------------------------------------------------------------
    def _after_commit(self, scheduled) -> None:
        for req in scheduled.requests:
            sh = self.shipments.get(req.request_id)
            if sh is not None and sh.abort_reason is None:
                self._ship(req, sh)

    def _on_finished(self, req: Request, reason: FinishReason) -> None:
        sh = self.shipments[req.request_id]
        if sh.abort_reason is None:  # an abort during this step already took it out of the batch
            sh.first_token = req.output_token_ids[-1]
            req.timings["compute_done"] = self.clock()
            self.scheduler.detach(req)

    def _fail_request(self, req: Request, error: str) -> list:
        self.fail_request(req.request_id, error)
        return []

    def _retractable(self, req: Request) -> bool:
        """A request whose own pages are lent to a write cannot be released yet. Its cached pages
        never stop a retract: every write reading them pins them by its own handle."""
        return not self.kvm.lent_pages(req.kv)

    # ---- shipping ----------------------------------------------------------------------------------
    def _ship(self, req: Request, sh: _Shipment) -> None:
        """Write the pages completed since the last call (all remaining ones once the prompt is done)."""
        kv, ps = req.kv, self.config.page_size
        prompt_len = len(req.prompt_token_ids)
        done = kv.kv_committed_len >= prompt_len
        upto = ceil_div(prompt_len, ps) if done else kv.kv_committed_len // ps
        if upto <= sh.pages_sent:
            return
        ops = self._write_ops(kv.pages, sh.landing, sh.pages_sent, upto)
        try:
            handle = self.transport.write(sh.landing.session, ops)
        except TransferError as exc:
            self.abort_transfer(req.request_id, FailureReason.TRANSPORT_ERROR, str(exc))
            return
        # The write reads cached pages too: a retract or abort may drop the request's tree lock
        # long before this handle retires, so the handle pins all it reads, whoever owns it.
        sh.handles.add(self.kvm.pin_for_transfer(kv, sh.pages_sent, upto, handle))
        sh.pages_sent = sh.pages_at_handle[handle] = upto
        if sh.session.state is TransferState.WAITING:
            sh.session.advance(TransferState.TRANSFERRING, self.clock())
            req.timings["first_write"] = self.clock()
        sh.bytes_sent += handle.num_bytes

    def _write_ops(self, pages: list[int], landing: Landing, start: int, stop: int) -> list[WriteOp]:
        """Layer-first layout: page i of layer l moves as one contiguous block per K and V;
        `coalesce` merges runs of consecutive pages on both sides into one op."""
        stride = landing.layout.page_bytes_per_tensor
        ops = []
        for layer, (k, v) in enumerate(zip(self.kv_cache.k, self.kv_cache.v)):
            for i in range(start, stop):
                dst_k, dst_v = landing.page_addrs(layer, i)
                ops.append(WriteOp(k.data_ptr() + pages[i] * stride, dst_k, stride))
                ops.append(WriteOp(v.data_ptr() + pages[i] * stride, dst_v, stride))
        return coalesce(ops)

    def _poll_writes(self) -> None:
        now = self.clock()
        for rid, sh in self.shipments.items():
            for handle in list(sh.handles):
                status = self.transport.poll(handle)
                if status is TransferStatus.PENDING:
                    continue
                if status is TransferStatus.FAILED:
                    self.abort_transfer(rid, FailureReason.TRANSPORT_ERROR, str(self.transport.error(handle)))
                    if not self.transport.settled(handle):
                        continue  # abandoned batches may still read these pages and write the landing
                sh.handles.discard(handle)
                self.transport.retire(handle)
                self.kvm.unpin_transfer(handle)  # terminal and settled: nothing reads its pages now
                if status is TransferStatus.DONE and sh.session.state is TransferState.TRANSFERRING:
                    sh.session.progress(now)
                    sh.pages_done = max(sh.pages_done, sh.pages_at_handle.pop(handle, 0))
                    if sh.first_token is None:  # once the prompt is done, KVComplete follows shortly
                        self.outbox.append(KVProgress(rid, sh.pages_done))

    def _retire_finished(self) -> None:
        """Release every request whose outstanding writes are all terminal and whose fate is known."""
        released = False
        for rid, sh in list(self.shipments.items()):
            if sh.handles or (sh.abort_reason is None and sh.first_token is None):
                continue
            req = self.requests.get(rid)
            if sh.abort_reason is None:
                sh.session.advance(TransferState.DONE, self.clock())
                req.timings["transfer_done"] = self.clock()
                self.outbox.append(KVComplete(rid, sh.first_token, req.cached_tokens, tuple(req.timings.items())))
                self.scheduler.release_detached(req, FinishReason.LENGTH)
            else:
                self.outbox.append(TransferAborted(rid, sh.abort_reason))
                if req is not None and req.status is RequestStatus.RUNNING:
                    self.scheduler.release_detached(req, FinishReason.ABORT)
            self.requests.pop(rid, None)
            del self.shipments[rid]
            released = True
        if released:
            self._after_step()
