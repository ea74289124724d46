"""The contract between the HTTP gateway and whatever serves its requests (the dispatcher over Ray
workers, or a test double). The gateway owns HTTP, OpenAI schemas, tokenization, detokenization and
request metrics; a backend owns routing, workers and KV.

A request's life through a backend:

    generate(request_id, prompt_token_ids, params)  ->  async iterator of GenerationChunk
        ... chunks with new tokens (finish_reason None) ...
        last chunk: finish_reason set ("stop" | "length" | "abort"); `error` non-empty when the
        request ended by a failure rather than by its own stop rules or the client.
    abort(request_id)  : the client went away; the backend releases the request's KV on every worker.
                         Idempotent; a no-op for unknown or finished requests.

Streaming sessions (a conversation whose history a worker keeps pinned between turns):

    open_session(capacity_tokens, idle_timeout_s) -> session id; BackendError QUEUE_FULL when the
                         session KV budget is full, REJECTED for arguments no worker can honour,
                         UNAVAILABLE when no worker can hold one
    generate(..., session_id=id)  a turn: `prompt_token_ids` is the whole conversation (the history
                         plus the new tokens); the backend serves it where the history is pinned and
                         reports the hit in the last chunk's `cached_tokens`. One turn at a time per
                         session. An unknown or closed session (or one lost with its worker) raises
                         BackendError NOT_FOUND before anything is yielded; a session the worker closed
                         on its own (idle timeout) is REJECTED by it.
    close_session(id) -> False when it was not open. A running turn ends as a plain request.

`generate` raises `BackendError` *before yielding anything* when the request cannot start (no
worker, queue full, rejected): either at once (a plain function returning the iterator, as the
dispatcher does) or from the first `__anext__`; the gateway handles both. Once it has yielded,
failures arrive as a final chunk with `error`. A final chunk with finish_reason "abort" and no
`error` only follows the client's own abort. `abort` may also be called after a stream broke this
contract, so it must stay idempotent.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from common.config import SamplingParams
from common.logprobs import TokenLogprobs
from common.protocol import GraphStats, SpecStats, TierStats, WorkerRole


class ErrorKind(enum.Enum):
    """Why a request failed; the gateway maps each to an HTTP status (DESIGN §8)."""

    REJECTED = "rejected"  # 400: the request can never be served (too long, bad token ids)
    QUEUE_FULL = "queue_full"  # 429: too many requests in flight; retry later
    UNAVAILABLE = "unavailable"  # 503 + Retry-After: no live worker, or the worker serving it died
    INTERNAL = "internal"  # 500: a bug; the message says what was seen
    NOT_FOUND = "not_found"  # 404: the streaming session is unknown, closed, or lost with its worker


class BackendError(Exception):
    def __init__(self, kind: ErrorKind, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.kind, self.message, self.retry_after_s = kind, message, retry_after_s


@dataclass(frozen=True)
class GenerationChunk:
    """New tokens of one request since the previous chunk (possibly several decode steps batched)."""

    new_token_ids: tuple[int, ...]
    finish_reason: str | None = None  # "stop" | "length" | "abort"; None while running
    error: str = ""  # non-empty: the request ended by a failure (then finish_reason == "abort")
    error_kind: ErrorKind | None = None  # set exactly when `error` is
    cached_tokens: int = 0  # on the last chunk: prompt tokens served by a prefix cache
    cached_tiers: tuple[int, int, int] | tuple[()] = ()  # on the last chunk: by tier (device, host, L3); () unknown
    kv_transfer_s: float | None = None  # on the last chunk, disaggregated only: prefill-side transfer time
    kv_transfer_bytes: int = 0  # on the last chunk, disaggregated only: KV bytes moved for the prompt
    prefill_worker: str = ""  # on the last chunk: the worker that computed the prompt ("" = the decode worker)
    decode_worker: str = ""  # on the last chunk
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per new token, when the request asked for them
    prompt_logprobs: tuple[TokenLogprobs | None, ...] = ()  # with its first tokens, when asked (None first)
    timings: dict[str, float] = field(default_factory=dict, compare=False)
    """On the last chunk: the finishing worker's monotonic timestamps by event ("reserved",
    "prefill_submitted", "compute_done", "first_write", "transfer_done", "load_start", "load_done",
    ... as the workers record them); comparable with this host's `time.monotonic()` only when the
    workers run on the same host (`tandem bench transfer`)."""
    timeline: dict = field(default_factory=dict, compare=False)
    """On the last chunk: where the request's time went (`router.timeline.describe`); {} unknown."""


@dataclass(frozen=True)
class WorkerGauge:
    """One worker's load as last reported (exported as per-worker gauges)."""

    worker_id: str
    role: WorkerRole
    alive: bool
    num_running: int
    num_waiting: int
    kv_usage: float  # device KV pages in use / usable pages, in [0, 1]
    landing_kv_usage: float | None  # decode workers' landing pool, in [0, 1]; None without one
    restarts: int
    host_cache_usage: float | None = None  # the L2 tier's pages in use, in [0, 1]; None without one
    tiers: TierStats | None = None  # cumulative KV-hierarchy figures; None before the first heartbeat
    graphs: GraphStats | None = None  # cumulative graph-runner figures; None before the first heartbeat
    spec: SpecStats | None = None  # cumulative speculative-decoding figures; None before the first heartbeat
    step_threads: tuple[tuple[int, int], ...] = ()  # (torch threads, steps run on that many); () without a core share


class Backend(Protocol):
    model_name: str
    tokenizer: Any  # a transformers tokenizer (chat template, encode, decode)
    max_model_len: int  # prompt + completion tokens at most

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 session_id: str = "", follow: str = "") -> AsyncIterator[GenerationChunk]:
        """`follow`: the id of a request in flight with the same prompt (choice 0 of `n`): go to the
        worker that decodes it and prefill there, where its prompt is cached."""
        ...

    async def abort(self, request_id: str) -> None: ...

    async def open_session(self, capacity_tokens: int, idle_timeout_s: float) -> str: ...

    async def close_session(self, session_id: str) -> bool: ...

    def num_requests(self) -> tuple[int, int]:
        """(running, waiting) across the backend, for gauges."""
        ...

    def worker_gauges(self) -> list[WorkerGauge]: ...
