"""One load client: sends its jobs at their arrival offsets, at most `max_concurrency` requests in
flight, and times every request from its streamed frames.

    arrival (offset)  --queue (waits for a concurrency slot)-->  sent  --ttft-->  first content frame
                      --itl, itl, ...--> last content frame (latency = sent -> last content frame)

A request that fails (HTTP status, an error frame, a broken stream, no content at all) becomes a
failed sample with its error text; it never stops the run (a pooled connection the server had closed
is not a failure: the transport sends such a request again, by the rule in transport.py). Times are
`time.perf_counter()` offsets from the client's run start; `ClientRun.start_wall_s` anchors them on the wall clock, so
runs of several clients (processes, nodes) can be merged on one time axis.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from dataclasses import dataclass, field
from typing import cast

import numpy as np

from cluster.bench.load.arrivals import arrival_offsets_s
from cluster.bench.load.datasets import (
    FIRST_TOKEN_ID,
    Conversation,
    Job,
    Prompt,
    SampleRequest,
    TextCodec,
    num_requests,
)
from cluster.bench.load.transport import HTTPStatusError, make_transport

WARMUP_OUTPUT_LEN = 4


@dataclass(frozen=True)
class Target:
    """Where requests go and what every body carries besides prompt and length (picklable: it travels
    to Ray actors)."""

    base_url: str
    endpoint: str = "/v1/completions"
    model: str | None = None  # None: the body names no model (the server's default)
    api_key: str | None = None
    ignore_eos: bool = True  # exact output lengths on servers that honour it (tandem, vLLM)
    temperature: float | None = 0.0  # None: the server's default
    extra_body: dict = field(default_factory=dict)
    http_library: str = "auto"  # transport.make_transport: "auto" (aiohttp when installed), "aiohttp", "httpx"

    @property
    def is_chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("chat/completions")

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(frozen=True)
class LoadShape:
    """How requests arrive: rate in requests/s (inf: all at once), gamma burstiness, client cap."""

    request_rate: float = float("inf")
    burstiness: float = 1.0
    max_concurrency: int | None = None  # None: no cap
    seed: int = 0  # of the arrival times

    def __post_init__(self):
        if self.request_rate <= 0 or self.burstiness <= 0:
            raise ValueError("--request-rate and --burstiness must be > 0")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("--max-concurrency must be >= 1")


@dataclass(frozen=True)
class RequestOutput:
    """One request as the client saw it; times in seconds."""

    index: int  # the job's index in the run
    turn: int  # 0: a single request; 1, 2, ...: a conversation's turn
    success: bool
    prompt_len: int  # the server's usage.prompt_tokens when it sends usage, else the dataset's count
    output_tokens: int  # usage.completion_tokens when sent, else the number of content frames
    ttft_s: float
    itl_s: tuple[float, ...]  # gaps between consecutive content frames
    latency_s: float  # sent -> last content frame
    start_s: float  # when it was sent, since the client's run start
    queue_s: float  # arrival -> sent: the wait for a concurrency slot
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when sent
    error: str = ""
    response_id: str = ""  # the response's `id` (a tandem server's timeline of it: `phases.py`)


@dataclass(frozen=True)
class ClientRun:
    outputs: tuple[RequestOutput, ...]
    start_wall_s: float  # time.time() at the run's start (offset 0 of the arrivals)
    duration_s: float  # run start -> the last request's end
    num_retries: int = 0  # requests sent again on a fresh connection (transport.py: when, and why it is safe)


# ---- one request ---------------------------------------------------------------------------------
def request_body(target: Target, prompt: Prompt, output_len: int, codec: TextCodec | None) -> dict:
    body: dict = {"stream": True, "stream_options": {"include_usage": True}}
    if target.is_chat:
        body["messages"] = _messages(prompt, codec)
        body["max_completion_tokens"] = body["max_tokens"] = output_len  # newer and older name
    else:
        if isinstance(prompt, tuple) and prompt and isinstance(prompt[0], dict):
            raise ValueError("chat messages need --endpoint /v1/chat/completions")
        body["prompt"] = list(prompt) if isinstance(prompt, tuple) else prompt
        body["max_tokens"] = output_len
    if target.model is not None:
        body["model"] = target.model
    if target.ignore_eos:
        body["ignore_eos"] = True
    if target.temperature is not None:
        body["temperature"] = target.temperature
    return {**body, **target.extra_body}


def _messages(prompt: Prompt, codec: TextCodec | None) -> list[dict]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if prompt and isinstance(prompt[0], dict):
        return list(prompt)
    if codec is None:
        raise ValueError("token-id prompts on the chat endpoint need a tokenizer (--tokenizer) to become text")
    token_ids = cast("tuple[int, ...]", prompt)  # neither text nor messages (above): token ids (`Prompt`)
    return [{"role": "user", "content": codec.decode(list(token_ids))}]


@dataclass
class _Stream:
    """What one response stream carried, as it arrives."""

    frame_times_s: list[float] = field(default_factory=list)  # perf_counter of each content frame
    texts: list[str] = field(default_factory=list)
    usage: dict | None = None
    response_id: str = ""

    def take(self, frame: dict, chat: bool) -> None:
        self.usage = frame.get("usage") or self.usage
        self.response_id = self.response_id or str(frame.get("id") or "")
        choices = frame.get("choices") or ()
        text = "".join((c.get("delta") or {}).get("content") or "" if chat else c.get("text") or "" for c in choices)
        if text:
            self.frame_times_s.append(time.perf_counter())
            self.texts.append(text)


async def stream_request(transport, target: Target, body: dict) -> tuple[_Stream, str]:
    """POST `body` and read its SSE stream to the end; ('' or the error text of a failed request)."""
    stream = _Stream()
    try:
        async with contextlib.aclosing(transport.sse_data(target.endpoint, body, target.headers)) as payloads:
            async for data in payloads:
                if data == "[DONE]":
                    continue  # read on to the end: a response left unread closes its keep-alive connection
                frame = json.loads(data)
                if "error" in frame:
                    return stream, f"error frame: {frame['error']}"
                stream.take(frame, target.is_chat)
    except Exception as exc:  # noqa: BLE001 - any failure of one request is that request's result
        return stream, str(exc) if isinstance(exc, HTTPStatusError) else f"{type(exc).__name__}: {exc}"
    return stream, "" if stream.frame_times_s else "no content frame in the stream"


async def send_one(transport, target: Target, prompt: Prompt, prompt_len: int | None, output_len: int,
                   codec: TextCodec | None, run_start_s: float, index: int, turn: int,
                   queue_s: float) -> tuple[RequestOutput, str]:
    """One timed request: (its sample, the text it streamed)."""
    body = request_body(target, prompt, output_len, codec)
    sent_s = time.perf_counter()
    stream, error = await stream_request(transport, target, body)
    usage = stream.usage or {}
    times = stream.frame_times_s
    ok = not error
    output = RequestOutput(
        index=index, turn=turn, success=ok,
        prompt_len=int(usage.get("prompt_tokens") or prompt_len or 0),
        output_tokens=int(usage.get("completion_tokens") or len(times)) if ok else 0,
        ttft_s=times[0] - sent_s if ok else 0.0,
        itl_s=tuple(np.diff(times).tolist()) if ok else (),
        latency_s=times[-1] - sent_s if ok else 0.0,
        start_s=sent_s - run_start_s, queue_s=queue_s,
        cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens"), error=error,
        response_id=stream.response_id)
    return output, "".join(stream.texts)


# ---- progress ------------------------------------------------------------------------------------
class _PlainProgress:
    """A progress line on stderr every ~10% (when tqdm is not installed)."""

    def __init__(self, total: int):
        self.total, self.done, self.next_report = total, 0, max(1, total // 10)

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.done >= self.next_report or self.done == self.total:
            print(f"  {self.done}/{self.total} requests", file=sys.stderr)
            self.next_report = self.done + max(1, self.total // 10)

    def close(self) -> None:
        pass


class _NoProgress:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def make_progress(total: int, enabled: bool):
    if not enabled:
        return _NoProgress()
    try:
        from tqdm import tqdm
    except ImportError:
        return _PlainProgress(total)
    return tqdm(total=total, unit="req", file=sys.stderr)


# ---- the run -------------------------------------------------------------------------------------
async def run_client(target: Target, jobs: list[Job], shape: LoadShape, codec: TextCodec | None = None,
                     show_progress: bool = False, start_at_wall_s: float | None = None) -> ClientRun:
    """Send `jobs` at their arrival offsets; returns every request's sample, in job and turn order.

    `start_at_wall_s`: wait until that `time.time()` before the run starts (clients on several nodes
    start together)."""
    offsets_s: np.ndarray | list[float] = arrival_offsets_s(len(jobs), shape.request_rate, shape.burstiness,
                                                            np.random.default_rng(shape.seed))
    traced_s = [job.arrival_s for job in jobs if isinstance(job, SampleRequest) and job.arrival_s is not None]
    if jobs and len(traced_s) == len(jobs):
        offsets_s = traced_s  # a trace's own arrival times
    cap = shape.max_concurrency
    slots = asyncio.Semaphore(cap) if cap else contextlib.nullcontext()
    progress = make_progress(num_requests(jobs), show_progress)
    async with make_transport(target.base_url, cap, target.http_library) as transport:
        if start_at_wall_s is not None:
            await asyncio.sleep(max(0.0, start_at_wall_s - time.time()))
        run_start_s, start_wall_s = time.perf_counter(), time.time()

        async def send(prompt, prompt_len, output_len, index, turn) -> tuple[RequestOutput, str]:
            arrival_s = time.perf_counter()
            async with slots:
                result = await send_one(transport, target, prompt, prompt_len, output_len, codec, run_start_s, index,
                                        turn, time.perf_counter() - arrival_s)
            progress.update(1)
            return result

        tasks = []
        for job, offset_s in zip(jobs, offsets_s):
            delay_s = run_start_s + offset_s - time.perf_counter()
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            tasks.append(asyncio.create_task(_run_job(job, send, codec)))
        per_job = await asyncio.gather(*tasks)
        duration_s = time.perf_counter() - run_start_s
    progress.close()
    return ClientRun(tuple(o for outputs in per_job for o in outputs), start_wall_s, duration_s, transport.num_retries)


async def _run_job(job: Job, send, codec: TextCodec | None) -> list[RequestOutput]:
    if isinstance(job, SampleRequest):
        output, _ = await send(job.prompt, job.prompt_len, job.output_len, job.index, 0)
        return [output]
    return await _run_conversation(job, send, codec)


async def _run_conversation(conv: Conversation, send, codec: TextCodec | None) -> list[RequestOutput]:
    """Turn after turn; a failed turn ends the conversation (its later turns count as failed)."""
    if codec is None:
        raise ValueError("the multi-turn dataset needs a tokenizer (--tokenizer) to resend answers")
    history: list[int] = []
    outputs = []
    for turn, (user, output_len) in enumerate(zip(conv.user_turns, conv.output_lens), start=1):
        if turn > 1 and conv.think_time_s:
            await asyncio.sleep(conv.think_time_s)
        prompt = (*history, *user)
        output, text = await send(prompt, len(prompt), output_len, conv.index, turn)
        outputs.append(output)
        if not output.success:
            outputs += [_skipped(conv.index, t, output.error) for t in range(turn + 1, conv.num_requests + 1)]
            break
        history = [*prompt, *codec.encode(text)]
    return outputs


def _skipped(index: int, turn: int, cause: str) -> RequestOutput:
    return RequestOutput(index, turn, False, 0, 0, 0.0, (), 0.0, 0.0, 0.0, None, f"not sent: an earlier turn failed "
                                                                                  f"({cause[:100]})")


def warmup_prompt(job: Job) -> Prompt:
    """A prompt of the first job's kind that shares no prefix with the dataset's (random ids do not
    start with 16 equal ones), so the warm-up leaves nothing in a prefix cache for the run to hit."""
    prompt = job.prompt if isinstance(job, SampleRequest) else job.user_turns[0]
    if isinstance(prompt, str):
        return "warm up " * 8
    if prompt and isinstance(prompt[0], dict):
        return ({"role": "user", "content": "warm up " * 8},)
    return (FIRST_TOKEN_ID,) * 16


async def warm_up(target: Target, jobs: list[Job], num_warmups: int, codec: TextCodec | None = None) -> None:
    """`num_warmups` untimed requests of a few tokens, one at a time: the server's first-call costs are
    paid before anything is measured. Raises when one fails: the run would too."""
    if not num_warmups or not jobs:
        return
    body = request_body(target, warmup_prompt(jobs[0]), WARMUP_OUTPUT_LEN, codec)
    async with make_transport(target.base_url, 1, target.http_library) as transport:
        for _ in range(num_warmups):
            _, error = await stream_request(transport, target, body)
            if error:
                raise RuntimeError(f"the warm-up request to {target.base_url}{target.endpoint} failed: {error}")
