"""One prefill and one decode worker driven in this process, messages passed by call.

The same worker classes run in separate processes over Mooncake; here the transport is whatever
the caller built (LocalTransport in unit tests). The router's part is trivial with one pair:
reserve a landing on the decode worker, hand the request to the prefill worker.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from cluster.config import SamplingParams
from decode_worker.worker import DecodeWorker
from prefill_worker.engine.core import StepOutput
from prefill_worker.engine.request import FinishReason
from prefill_worker.worker import PrefillWorker


@dataclass
class PairResult:
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str = ""


class LocalPair:
    """Not thread-safe. `step` advances both workers once and routes their messages."""

    def __init__(self, prefill: PrefillWorker, decode: DecodeWorker, prefill_id: str = "prefill-0"):
        self.prefill, self.decode, self.prefill_id = prefill, decode, prefill_id
        self.pending: deque[tuple[str, list[int], SamplingParams]] = deque()  # waiting for a landing
        self.results: dict[str, PairResult] = {}

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.results[request_id] = PairResult(request_id)
        self.pending.append((request_id, list(prompt_token_ids), params))

    def abort(self, request_id: str) -> None:
        """Client abort: the request ends now (for the caller); the workers release its KV."""
        res = self.results[request_id]
        if res.finish_reason is not None:
            return
        res.finish_reason = FinishReason.ABORT
        for item in self.pending:
            if item[0] == request_id:
                self.pending.remove(item)
                return
        self.decode.abort(request_id)

    def busy(self) -> bool:
        return bool(self.pending) or self.prefill.has_unfinished() or self.decode.has_unfinished()

    def step(self) -> list[StepOutput]:
        self._dispatch()
        self.prefill.step()
        for msg in self.prefill.outbox:
            self.decode.on_message(msg)
        self.prefill.outbox.clear()
        outputs = self.decode.step()
        for _peer, msg in self.decode.outbox:
            self.prefill.on_message(msg)
        self.decode.outbox.clear()
        for out in outputs:
            res = self.results[out.request_id]
            if res.finish_reason is not None:
                continue  # aborted by the client: later output is dropped
            res.token_ids += out.new_token_ids
            if out.finish_reason is not None:
                res.finish_reason, res.error = out.finish_reason, out.error
        return outputs

    def generate(self, prompts: Sequence[list[int]], params: SamplingParams, max_steps: int = 100_000) -> list[PairResult]:
        ids = [f"pair-{len(self.results) + i}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts):
            self.submit(rid, prompt, params)
        for _ in range(max_steps):
            if not self.busy():
                break
            self.step()
        else:
            raise TimeoutError(f"pair still busy after {max_steps} steps")
        return [self.results[rid] for rid in ids]

    def _dispatch(self) -> None:
        while self.pending:
            rid, prompt, params = self.pending[0]
            landing = self.decode.reserve(rid, prompt, params, self.prefill_id)
            if landing is None:
                return  # host tier full: retry next step
            self.pending.popleft()
            self.prefill.submit(rid, prompt, params, landing)
