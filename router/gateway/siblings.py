"""Requests with several choices: `n` per prompt, and a completion's batch of prompts. One run per
choice; choice j of prompt i is `index` i * n + j (vLLM's order).

Choice 0 starts first, asking its engine to put its prompt in the prefix tree as soon as it is
computed (`share_prompt`); the others start once its first token is out, so its prompt is in the
decode worker's prefix cache by then: disaggregated, the prompt's KV crossed once, and each sibling
computes only the prompt's last partial page (the prefix cache holds whole pages; the last token is
always computed, for the sibling's own first-token logits). Seeds: choice i of a request seeded
with s draws with `sibling_seed(s, i)` (choice 0 with s itself), so the n samples differ from each
other and repeat exactly; unseeded, every choice draws its own seed.

Non-streaming, the body has the n choices in index order; streaming, frames of the choices
interleave as their tokens come, each naming its `index`, and the usage frame (when asked) comes
after every choice finished. Usage counts each prompt once and every choice's completion tokens. A
choice that fails fails the request: its error is the response (or the stream's error frame), and
the other choices are aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from dataclasses import replace
from typing import Any

from common.config import SEED_MAX
from router.gateway.errors import APIError, internal
from router.gateway.metrics import GatewayMetrics
from router.gateway.responses import SSE_DONE, ResponseShape, Usage, sse_error
from router.gateway.schema import GenerateRequest
from router.gateway.streaming import Finished, GenerationRun, choice_of


def sibling_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request seeded with `seed`: choice 0 keeps it (a request with
    n = 1 is the same request), the others mix the index in, so siblings draw different numbers and
    the same ones on every repeat, whatever else runs. In [SEED_MIN, SEED_MAX] (`common.config`)."""
    if index == 0:
        return seed
    mixed = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9) % 2**64
    return mixed - 2**64 if mixed > SEED_MAX else mixed


class Siblings:
    """The runs of one request's `n` choices; used as `GenerationRun` is: `start`, then `frames` or
    `body`, and always `close`."""

    def __init__(self, backend: Any, request_id: str, request: GenerateRequest, metrics: GatewayMetrics,
                 arrival_s: float):
        self.request, n = request, request.n
        ids = [request_id if k == 0 else f"{request_id}-{k}" for k in range(n * len(request.prompts))]
        self.runs: list[GenerationRun] = []
        for i, prompt in enumerate(request.prompts):
            for j in range(n):
                leader = self.runs[i * n] if j and request.params.prompt_logprobs is not None else None
                self.runs.append(GenerationRun(backend, ids[i * n + j], _choice(request, prompt, j, ids[i * n]),
                                               metrics, arrival_s, prompt_from=leader))
        self.leaders = self.runs[::n]
        """Each prompt's choice 0 (its prompt's logprobs are its siblings' too)."""

    async def start(self) -> None:
        """Each prompt's choice 0 to its first token, then the others. Raises the first refusal (`APIError`)."""
        await asyncio.gather(*(run.start() for run in self.leaders))
        await asyncio.gather(*(run.start() for run in self.runs if run not in self.leaders))

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
        finished: list[tuple[str, Finished]] = []
        for text, outcome in outcomes:
            if isinstance(outcome, APIError):
                return outcome
            finished.append((text, outcome))
        prompts = [p for p in self.request.prompts for _ in range(self.request.n)]
        choices = [choice_of(text, outcome, self.request, prompt) for prompt, (text, outcome) in zip(prompts, finished)]
        return shape.full_choices(choices, self._usage([outcome for _, outcome in finished]))

    async def frames(self, shape: ResponseShape, include_usage: bool) -> AsyncGenerator[bytes, None]:
        """The SSE body: every choice's opening frames, then their frames as they come."""
        for index in range(len(self.runs)):
            for frame in shape.opening_frames(index):
                yield frame
        streams = {index: run.events() for index, run in enumerate(self.runs)}
        pending = {asyncio.ensure_future(anext(stream)): index for index, stream in streams.items()}
        finished: list[Finished | None] = [None] * len(self.runs)
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    index = pending.pop(task)
                    try:
                        event = task.result()
                    except StopAsyncIteration:
                        continue
                    except Exception as exc:  # noqa: BLE001 - our bug mid-stream: the client still gets an end
                        yield sse_error(self.runs[index].fail(internal(exc)))
                        yield SSE_DONE
                        return
                    if isinstance(event, APIError):
                        yield sse_error(event)
                        yield SSE_DONE
                        return
                    if isinstance(event, Finished):
                        finished[index] = event
                        yield shape.finish_frame(event.finish_reason, index)
                    else:
                        yield shape.delta_frame(event, index)
                    pending[asyncio.ensure_future(anext(streams[index]))] = index
            if include_usage:
                ended = [f for f in finished if f is not None]
                assert len(ended) == len(finished), "a choice's stream ended without its Finished"
                yield shape.usage_frame(self._usage(ended))
            yield SSE_DONE
        finally:
            for task in pending:
                task.cancel()
            for stream in streams.values():
                with contextlib.suppress(Exception):
                    await stream.aclose()

    def _usage(self, finished: list[Finished]) -> Usage:
        """Each prompt once (its cached tokens its choice 0's: what the prompt cost), every completion."""
        leaders = [f.usage for f in finished[::self.request.n]]
        tiers: tuple[int, int, int] | tuple[()] = ()
        if leaders and all(u.cached_tiers for u in leaders):  # (device, host, L3) summed
            device, host, l3 = (sum(by_tier) for by_tier in zip(*(u.cached_tiers for u in leaders)))
            tiers = (device, host, l3)
        return Usage(sum(u.prompt_tokens for u in leaders), sum(f.usage.completion_tokens for f in finished),
                     sum(u.cached_tokens for u in leaders), tiers)


def _choice(request: GenerateRequest, prompt: list[int], index: int, leader_id: str) -> GenerateRequest:
    """Choice `index` of `prompt`: its own request, n = 1, its seed (`sibling_seed`; unseeded: its own
    draw); choice 0 puts its prompt in the prefix tree as soon as it is computed (`share_prompt`), the
    others follow it (`follow` = `leader_id`: to its decode worker, prefilling there)."""
    seed = request.params.seed
    params = replace(request.params, share_prompt=index == 0 and request.n > 1)
    if index:  # its prompt's logprobs are its leader's: it computes only the prompt's last page
        params = replace(params, prompt_logprobs=None)
    if seed is not None:
        params = replace(params, seed=sibling_seed(seed, index))
    return replace(request, prompt_token_ids=prompt, more_prompts=(), params=params, n=1,
                   follow=leader_id if index else "")
