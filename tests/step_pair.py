"""A prefill and a decode worker driven in lockstep on the test's thread, through the worker contract
(`handle` / `step`), for tests that must control every single step (which write is pending when a
retract happens, say). Messages go straight from one worker to the other; there is no routing, no
re-routing and no timeout here: everything else drives the real relay, `router.dispatcher`."""

from __future__ import annotations

from dataclasses import dataclass, field

from common import protocol as p
from common.config import SamplingParams
from engine.request import FinishReason


@dataclass
class PairResult:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str = ""
    failure: p.Failure | None = None  # with error: TRANSFER (worth a retry) or INTERNAL


class StepPair:
    def __init__(self, prefill, decode):
        self.prefill, self.decode = prefill, decode
        self.results: dict[str, PairResult] = {}

    def submit(self, request_id: str, prompt: list[int], params: SamplingParams) -> PairResult:
        [reserved] = self.decode.handle(p.Reserve(request_id, tuple(prompt), params, "prefill-0"))
        assert reserved.landing is not None, f"no landing for {request_id}: {reserved.error or 'host tier full'}"
        self.results[request_id] = PairResult()
        self._to_decode(self.prefill.handle(p.Prefill(request_id, tuple(prompt), params, reserved.landing)))
        return self.results[request_id]

    def abort(self, request_id: str) -> None:
        """The client gives up; the decode worker tells the prefill worker on its next step."""
        self.decode.handle(p.Abort(request_id))

    def step(self) -> None:
        self._to_decode(self.prefill.step())
        for msg in self.decode.step():
            if isinstance(msg, p.TokenOutput):
                result = self.results[msg.request_id]
                result.token_ids += msg.new_token_ids
                if msg.finish_reason is not None:
                    result.finish_reason, result.error = msg.finish_reason, msg.error
                    result.failure = msg.failure
            else:
                self.prefill.handle(msg)  # AbortTransfer

    def busy(self) -> bool:
        return self.prefill.busy() or self.decode.busy()

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[PairResult]:
        results = [self.submit(f"req-{i}", prompt, params) for i, prompt in enumerate(prompts)]
        while self.busy():
            self.step()
        return results

    def _to_decode(self, msgs: list) -> None:
        for msg in msgs:  # KVProgress, KVComplete, TransferAborted
            self.decode.handle(msg)
