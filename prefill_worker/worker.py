"""Prefill worker: the engine with a `KVSender`, behind the worker contract (`common.protocol.Worker`).

It takes `Prefill` (compute a prompt's KV into a decode worker's landing), `PrefillAnswer` (cache a
finished turn's answer for the conversation's next turn), `AbortTransfer` and `PeerDead`; what it
sends back (KVProgress, KVComplete, TransferAborted) goes to the decode worker
through the dispatcher. Its sampled token is not a client's: it reaches the decode worker inside
`KVComplete`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from common import protocol as p
from common.config import SamplingParams
from common.protocol import WorkerRole
from engine.core import EngineCore
from engine.worker_base import EngineWorker
from kv_store.kv_manager import ceil_div
from kv_store.transfer.session import FailureReason
from prefill_worker.sender import KVSender

ANSWER_PARAMS = SamplingParams(max_tokens=1)  # an answer's prefill samples one token, which nobody reads


class PrefillWorker(EngineWorker):
    """Not thread-safe: one loop calls `handle` and `step`."""

    role = WorkerRole.PREFILL

    def __init__(self, engine: EngineCore):
        """`engine`: built with a `KVSender` (`cluster/worker_host/build.py:make_worker`)."""
        assert isinstance(engine.connector, KVSender), "a prefill worker's engine ships KV through a KVSender"
        super().__init__(engine)
        self.sender: KVSender = engine.connector

    # ---- the messages ------------------------------------------------------------------------------
    def _prefill(self, msg: p.Prefill) -> list[p.FromWorker]:
        try:
            self.submit(msg.request_id, list(msg.prompt_token_ids), msg.params, msg.landing)
        except ValueError as exc:
            return [p.TransferAborted(msg.request_id, f"rejected: {exc}")]
        return []

    def _prefill_answer(self, msg: p.PrefillAnswer) -> list[p.FromWorker]:
        self.prefill_answer(msg.request_id, msg.token_ids, msg.prompt_len)
        return []

    def _abort_transfer(self, msg: p.AbortTransfer) -> list[p.FromWorker]:
        self.sender.abort_transfer(msg.request_id, FailureReason.ABORTED, msg.reason)
        self.engine.end_stopped()
        return []

    def _peer_dead(self, msg: p.PeerDead) -> list[p.FromWorker]:
        self.sender.peer_dead(msg.peer)
        self.engine.end_stopped()
        return []

    HANDLERS = {p.Prefill: _prefill, p.PrefillAnswer: _prefill_answer, p.AbortTransfer: _abort_transfer,
                p.PeerDead: _peer_dead}

    # ---- the worker contract -----------------------------------------------------------------------
    def fail_request(self, msg: p.AboutRequest, error: str) -> list[p.FromWorker]:
        """A fault while handling `msg` (about one request) ends that request's transfer: the decode
        worker hears `TransferAborted` (from a later step), and the KV is released once no write reads it."""
        self._abort_unshipped(msg.request_id)
        self.sender.abort_transfer(msg.request_id, FailureReason.ABORTED, error, p.Failure.INTERNAL)
        self.engine.end_stopped()
        return []

    def _answer_failed(self, msg: p.PrefillAnswer, error: str) -> list[p.FromWorker]:
        """Nobody waits for an answer's prefill: it ends with no transfer to abort and no reply."""
        self._abort_unshipped(msg.request_id)
        return []

    FAULTS = {p.PrefillAnswer: _answer_failed}

    def _abort_unshipped(self, request_id: str) -> None:
        if request_id not in self.sender.shipments:  # failed before its transfer opened
            self.engine.abort(request_id)

    def step(self) -> list[p.FromWorker]:
        self.engine.step()  # the sampled first tokens travel inside KVComplete
        out: list[p.FromWorker] = list(self.sender.outbox)
        self.sender.outbox = []
        return out

    def stats(self) -> p.WorkerStats:
        return self.engine.stats(self.role, transfers=len(self.sender.shipments))

    # ---- requests ----------------------------------------------------------------------------------
    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, landing: p.Landing) -> None:
        """Prefill `prompt_token_ids` into `landing`. Raises ValueError (holding nothing) on a bad landing."""
        landing.layout.check_compatible(self.sender.layout)
        need = ceil_div(len(prompt_token_ids), self.engine.config.page_size)
        if len(landing.page_ids) != need:
            raise ValueError(f"landing for {request_id} has {len(landing.page_ids)} pages, the prompt needs {need}")
        # Prefill samples only the first token (under the request's logit rules: min_tokens holds its
        # stop tokens back there too); the decode worker applies the stop rules to it.
        first = dataclasses.replace(params, max_tokens=1, stop=(), min_tokens=min(params.min_tokens, 1))
        req = self.engine.add_request(prompt_token_ids, first, request_id)
        self.sender.open(req, landing)

    def prefill_answer(self, request_id: str, token_ids: Sequence[int], prompt_len: int) -> bool:
        """Queue the prefill of `token_ids`' whole pages past the cached prompt, at most one chunk of them,
        as a request that ships nothing: released into the cache like any finished request. False when
        there is nothing to compute (the answer adds no whole page, or it is cached already), when the
        prompt's pages are no longer cached (extending them would recompute the prompt, which the
        cache just let go), or when the engine cannot take it."""
        ps, chunk = self.engine.config.page_size, self.engine.config.chunk_size
        whole = len(token_ids) // ps * ps
        cached = self.engine.cached_prefix_len(token_ids)
        if whole <= cached or cached < prompt_len // ps * ps:
            return False
        upto = max(whole if whole - cached <= chunk else (cached + chunk) // ps * ps, cached + ps)
        try:
            self.engine.add_request(list(token_ids[:upto]), ANSWER_PARAMS, request_id)
        except ValueError:  # longer than this worker holds, or the id is taken: the next turn prefills it
            return False
        return True
