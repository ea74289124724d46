"""What a step hands its worker for each request it advanced or ended (streaming granularity).

Both the engine and its connectors produce these: the engine for the rows it ran, a connector for
requests it ended outside the batch (a transfer that failed, a first token that finished a request).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from common.logprobs import TokenLogprobs
from common.protocol import Failure
from engine.request import FinishReason, Request


@dataclass(frozen=True)
class StepOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None  # None while the request is still running
    error: str = ""  # why an ABORT that the client did not ask for happened (e.g. a transfer failed)
    failure: Failure | None = None  # with `error`: why (None exactly when `error` is empty)
    cached_tokens: int = 0  # set on the finishing output
    timings: tuple[tuple[str, float], ...] = ()  # set on the finishing output
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per new token, when the request asked for them
    cached_tiers: tuple[int, int, int] | tuple[()] = ()  # on the finishing output: cached tokens (device, host, L3)
    prompt_logprobs: tuple[TokenLogprobs | None, ...] = ()  # on its first output carrying them, when asked


def step_output(req: Request, tokens: list[int], reason: FinishReason | None, error: str = "",
                failure: Failure | None = None) -> StepOutput:
    """`req`'s progress (the logprobs of `tokens`, the last of its output, and its prompt's once,
    when asked); a finishing one carries its cached tokens and timings."""
    logprobs = tuple(req.output_logprobs[len(req.output_logprobs) - len(tokens):]) if tokens and \
        req.params.logprobs is not None else ()
    prompt_logprobs: tuple[TokenLogprobs | None, ...] = ()
    if req.params.prompt_logprobs is not None and not req.prompt_logprobs_sent and tokens:
        prompt_logprobs, req.prompt_logprobs_sent = tuple(req.prompt_logprobs), True
    if reason is None:
        return StepOutput(req.request_id, tokens, None, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
    req.timings.setdefault("finished", time.monotonic())
    return StepOutput(req.request_id, tokens, reason, error, failure, req.cached_tokens, tuple(req.timings.items()),
                      logprobs, req.cached_tiers, prompt_logprobs)
