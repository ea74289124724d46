"""Requests with several choices (`n`): one sibling run per choice over the same prompt.

Choice 0 starts first, asking its engine to put its prompt in the prefix tree as soon as it is
computed (`share_prompt`); the others start once its first token is out, so its prompt is in the
decode worker's prefix cache by then: disaggregated, the prompt's KV crossed once, and each sibling
computes only the prompt's last partial page (the prefix cache holds whole pages; the last token is
always computed, for the sibling's own first-token logits). Seeds: choice i of a request seeded
with s draws with `sibling_seed(s, i)` (choice 0 with s itself), so the n samples differ from each
other and repeat exactly; unseeded, every choice draws its own seed.

Non-streaming, the body has the n choices in index order; streaming, frames of the choices
interleave as their tokens come, each naming its `index`, and the usage frame (when asked) comes
after every choice finished. Usage counts the prompt once and every choice's completion tokens. A
choice that fails fails the request: its error is the response (or the stream's error frame), and
the other choices are aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from common.config import sibling_seed
from router.gateway.errors import APIError, internal
from router.gateway.metrics import GatewayMetrics
from router.gateway.responses import SSE_DONE, ResponseShape, TokenIds, Usage, sse_error
from router.gateway.schema import GenerateRequest
from router.gateway.streaming import Finished, GenerationRun


class Siblings:
    """The runs of one request's `n` choices; used as `GenerationRun` is: `start`, then `frames` or
    `body`, and always `close`."""

    def __init__(self, backend: Any, request_id: str, request: GenerateRequest, metrics: GatewayMetrics,
                 arrival_s: float):
        self.request = request
        self.runs = [GenerationRun(backend, request_id if i == 0 else f"{request_id}-{i}",
                                   _choice(request, i, request_id), metrics, arrival_s) for i in range(request.n)]

    async def start(self) -> None:
        """Choice 0 to its first token, then the others together. Raises the first refusal (`APIError`)."""
        await self.runs[0].start()
        await asyncio.gather(*(run.start() for run in self.runs[1:]))

    def fail(self, err: APIError) -> APIError:
        for run in self.runs:
            run.fail(err)
        return err

    async def close(self) -> None:
        for run in self.runs:
            await run.close()

    async def body(self, shape: ResponseShape) -> dict | APIError:
        """The non-streaming body, or the error of the first choice that failed."""
        outcomes = await asyncio.gather(*(run.collect() for run in self.runs))
        for _, outcome in outcomes:
            if isinstance(outcome, APIError):
                return outcome
        prompt = tuple(self.request.prompt_token_ids)
        choices = [(text, outcome.finish_reason,
                    TokenIds(prompt, tuple(outcome.output_token_ids)) if self.request.return_token_ids else None)
                   for text, outcome in outcomes]
        return shape.full_choices(choices, _usage([outcome for _, outcome in outcomes]))

    async def frames(self, shape: ResponseShape, include_usage: bool) -> AsyncIterator[bytes]:
        """The SSE body: every choice's opening frames, then their frames as they come."""
        for index in range(len(self.runs)):
            for frame in shape.opening_frames(index):
                yield frame
        streams = {index: run.events() for index, run in enumerate(self.runs)}
        pending = {asyncio.ensure_future(anext(stream)): index for index, stream in streams.items()}
        finished: list[Finished] = []
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    index = pending.pop(task)
                    try:
                        event = task.result()
                    except StopAsyncIteration:
                        continue
                    except Exception as exc:  # a bug on our side mid-stream: the client still gets an end
                        yield sse_error(self.runs[index].fail(internal(exc)))
                        yield SSE_DONE
                        return
                    if isinstance(event, APIError):
                        yield sse_error(event)
                        yield SSE_DONE
                        return
                    if isinstance(event, Finished):
                        finished.append(event)
                        yield shape.finish_frame(event.finish_reason, index)
                    else:
                        yield shape.delta_frame(event, index)
                    pending[asyncio.ensure_future(anext(streams[index]))] = index
            if include_usage:
                yield shape.usage_frame(_usage(finished))
            yield SSE_DONE
        finally:
            for task in pending:
                task.cancel()
            for stream in streams.values():
                with contextlib.suppress(Exception):
                    await stream.aclose()


def _choice(request: GenerateRequest, index: int, first_id: str) -> GenerateRequest:
    """Choice `index`'s own request: n = 1, its seed (`sibling_seed`; unseeded: its own draw); choice
    0 puts its prompt in the prefix tree as soon as it is computed (`share_prompt`), the others
    follow it (`follow`: to its decode worker, prefilling there)."""
    seed = request.params.seed
    params = replace(request.params, share_prompt=index == 0)
    if seed is not None:
        params = replace(params, seed=sibling_seed(seed, index))
    return replace(request, params=params, n=1, follow=first_id if index else "")


def _usage(finished: list[Finished]) -> Usage:
    """The prompt once (its cached tokens choice 0's: what the prompt cost), every completion."""
    first = finished[0].usage
    return Usage(first.prompt_tokens, sum(f.usage.completion_tokens for f in finished), first.cached_tokens)
