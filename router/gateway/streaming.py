"""One request's trip through the backend: chunks in, text deltas and metrics out, abort on the way out.

`GenerationRun` owns the backend stream of one request. Every way it can end meets in `close()`:

    backend finished (last chunk)    -> no abort; metrics already recorded by `events()`
    a stop string ended the text     -> abort (the backend may still be generating), before the
                                        outcome is given; success "stop"
    client gone / handler cancelled  -> abort; failure "client_disconnect"
    backend failure (error chunk)    -> no abort (the backend ended it); failure by its error kind
    backend broke its contract       -> abort (idempotent, so harmless); failure "internal"
      (raised after starting, stream ended without a last chunk)

`close()` is idempotent and shielded from cancellation, so `backend.abort` runs exactly once, even
from a stream that the server cancelled because its client disconnected.

`on_end` (a session turn's `end`) hears how the run ended once, before the client does: `Finished`,
the `APIError` it failed with, or None (the client went away; after the abort).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from common.logprobs import TokenLogprobs
from router.backend import BackendError, ErrorKind, GenerationChunk
from router.gateway.detokenize import IncrementalDetokenizer
from router.gateway.errors import CLIENT_DISCONNECT, APIError, from_backend_error, from_error_kind, internal, invalid
from router.gateway.logprobs import Entry
from router.gateway.metrics import GatewayMetrics, RequestClock
from router.gateway.responses import SSE_DONE, Choice, Delta, ResponseShape, TokenIds, Usage, sse_error
from router.gateway.schema import GenerateRequest
from router.gateway.tool_parsers import ToolCall
from router.gateway.tools import ContentStream, output_calls

log = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 10.0  # a backend that cannot abort in this long is not waited for
T = TypeVar("T")


@dataclass(frozen=True)
class Finished:
    """The request ended by its own rules; the remaining text is in the last delta before this."""

    finish_reason: str
    usage: Usage
    output_token_ids: tuple[int, ...] = ()  # every token the backend sent
    text: str = ""  # the whole text (cut before a stop string)
    logprobs: tuple[Entry, ...] | None = None  # every output token's, when asked (an echoed prompt's first)
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None  # when asked (`prompt_logprobs`, echo)
    tool_calls: tuple[ToolCall, ...] = ()  # read from the output (`router.gateway.tools`); then `text` is the rest


class GenerationRun:
    """Drives `backend.generate` for one request. Use: `await start()`, iterate `events()`, `close()`."""

    def __init__(self, backend: Any, request_id: str, request: GenerateRequest, metrics: GatewayMetrics,
                 arrival_s: float, on_end: Callable[[Finished | APIError | None], None] | None = None,
                 prompt_from: GenerationRun | None = None):
        """`prompt_from`: the run whose prompt logprobs are this one's (an `n` sibling's leader)."""
        self._backend, self.request_id, self._request = backend, request_id, request
        self._prompt_from = prompt_from
        self.prompt_logprobs: tuple[TokenLogprobs | None, ...] = ()  # as the backend sent them
        self._logprobs: list[Entry] = []  # every output token's (when asked)
        self._content = ContentStream(request.tools) if request.tools is not None else None
        self._calls: tuple[ToolCall, ...] = ()  # the output's tool calls, once it ended
        self._unsent = 0  # of them, not yet in a delta
        self._on_end = on_end
        self._metrics = metrics
        self._clock = RequestClock(metrics, arrival_s)
        self._detok = IncrementalDetokenizer(backend.tokenizer, request.params.stop)
        self._chunks: AsyncIterator[GenerationChunk] | None = None
        self._first: GenerationChunk | None = None  # received by start(), not yet taken by events()
        self._num_chunks = 0
        self._backend_done = False  # the backend sent its last chunk or refused to start: no abort needed
        self._ended = False  # this run's outcome is decided and counted
        self._closed = False

    async def start(self) -> None:
        """Wait for the first chunk. Raises `APIError` when the backend refuses the request; the caller
        answers with it and counts it through `fail`."""
        self._first = await self._next_chunk()
        if self._first.error and not self._first.new_token_ids:
            self._backend_done = True  # an error chunk is the last one
            if self._first.error_kind is ErrorKind.REJECTED and self._request.grammar_param and "grammar" in \
                    self._first.error:  # a worker found the grammar unusable: name the field it came from
                raise invalid(f"`{self._request.grammar_param}`: {self._first.error}",
                              param=self._request.grammar_param, code="invalid_grammar")
            raise from_error_kind(self._first.error_kind, self._first.error)
        self._metrics.prompt_tokens.inc(len(self._request.prompt_token_ids))
        self._metrics.temperature.observe(self._request.params.temperature)
        self._metrics.top_p.observe(self._request.params.top_p)

    async def events(self) -> AsyncGenerator[Delta | Finished | APIError, None]:
        """Deltas (an echoed prompt's first; never empty), then exactly one `Finished` or `APIError`."""
        assert self._first is not None, "events() before a successful start()"
        chunk, self._first = self._first, None
        if self._request.ask.echo:
            self._take_prompt(chunk)
            prompt = self._backend.tokenizer.decode(list(self._request.prompt_token_ids), skip_special_tokens=False)
            yield Delta(prompt, self._prompt_entries(), prompt=True)
        while True:
            text, last = self._take(chunk)
            if self._content is not None:
                text = self._tool_content(self._content, text, last and not chunk.error)
            entries = tuple(self._logprobs[len(self._logprobs) - self._unsent:]) if self._unsent and \
                (text or last) else ()
            calls = self._calls if last else ()
            if (text or entries or calls) and not self._request.ask.prompt_only:
                self._unsent -= len(entries)
                yield Delta(text, entries, tool_calls=calls)
            if last:
                break
            try:
                chunk = await self._next_chunk()
            except APIError as err:  # outside the contract once started: reported, and aborted in close()
                yield self.fail(err)
                return
        await self._abort_backend()  # a stop string the backend missed: it may still be generating
        yield self._outcome(chunk)

    async def collect(self) -> tuple[str, Finished | APIError]:
        """The whole text and the outcome (non-streaming)."""
        parts = []
        async for event in self.events():
            if isinstance(event, Delta):
                parts.append(event.text)
            else:
                return "".join(parts), event
        raise AssertionError("events() ended without an outcome")

    async def close(self) -> None:
        """End the run: abort the backend request unless it finished; count a run that never ended as
        a client disconnect. Idempotent; shielded, so it completes inside a cancelled task."""
        if self._closed:
            return
        self._closed = True
        if not self._ended:
            self._ended = True
            self._metrics.failure.labels(kind=CLIENT_DISCONNECT).inc()
        with anyio.CancelScope(shield=True):
            await self._abort_backend()
            self._tell_end(None)
            if self._chunks is not None and hasattr(self._chunks, "aclose"):
                await self._quietly(self._chunks.aclose(), "close the stream of")

    # ---- helpers -------------------------------------------------------------------------------
    async def _abort_backend(self) -> None:
        """Abort the backend request unless it is over (once; shielded)."""
        if self._backend_done:
            return
        self._backend_done = True
        with anyio.CancelScope(shield=True):
            await self._quietly(self._backend.abort(self.request_id), "abort")

    def _tell_end(self, outcome: Finished | APIError | None) -> None:
        on_end, self._on_end = self._on_end, None
        if on_end is not None:
            on_end(outcome)

    async def _quietly(self, cleanup: Awaitable[None], what: str) -> None:
        """Await a cleanup step; a failing or hanging one is logged, never raised to the client."""
        try:
            with anyio.move_on_after(ABORT_TIMEOUT_S) as scope:
                await cleanup
            if scope.cancelled_caught:
                log.warning("backend did not %s %s within %s s", what, self.request_id, ABORT_TIMEOUT_S)
        except Exception:
            log.exception("backend failed to %s %s", what, self.request_id)

    async def _next_chunk(self) -> GenerationChunk:
        """The backend's next chunk; any way its stream breaks becomes an `APIError`."""
        try:
            if self._chunks is None:  # inside the try: a backend may raise from generate() itself
                self._chunks = aiter(self._generate())
            chunk = await anext(self._chunks)
            self._num_chunks += 1
            return chunk
        except BackendError as exc:
            # raised before the first chunk, it means the request never started: nothing to abort
            self._backend_done = self._backend_done or self._num_chunks == 0
            raise from_backend_error(exc) from None
        except StopAsyncIteration:
            raise internal(RuntimeError("the backend ended the stream without a last chunk")) from None
        except Exception as exc:  # noqa: BLE001 - logged with its traceback by internal()
            raise internal(exc) from None

    def _generate(self) -> AsyncIterator[GenerationChunk]:
        args = (self.request_id, self._request.prompt_token_ids, self._request.params)
        if self._request.session_id:
            return self._backend.generate(*args, session_id=self._request.session_id)
        if self._request.follow:
            return self._backend.generate(*args, follow=self._request.follow)
        return self._backend.generate(*args)  # as before sessions: a backend without them still serves

    def _tool_content(self, content: ContentStream, text: str, ended: bool) -> str:
        """The content part of `text` (the calls are held back); once the output `ended`, its calls."""
        text = content.feed(text)
        if ended:
            _, calls = output_calls(content.ask, self._detok.text)
            self._calls = tuple(calls)
            if not calls:
                text += content.flush()
        return text

    def _take_prompt(self, chunk: GenerationChunk) -> None:
        if chunk.prompt_logprobs:
            self.prompt_logprobs = chunk.prompt_logprobs

    def _prompt_entries(self) -> tuple[Entry, ...]:
        """The prompt's tokens with their logprobs (a leader's, for a sibling), when asked; else ()."""
        values = self._prompt_from.prompt_logprobs if self._prompt_from is not None else self.prompt_logprobs
        if self._request.params.logprobs is None or not values:
            return ()
        return tuple(zip(self._request.prompt_token_ids, values))

    def _take(self, chunk: GenerationChunk) -> tuple[str, bool]:
        """(text delta of `chunk`, whether the run's text is complete after it)."""
        self._take_prompt(chunk)
        if self._request.params.logprobs is not None:
            self._logprobs += zip(chunk.new_token_ids, chunk.logprobs)
            self._unsent += min(len(chunk.new_token_ids), len(chunk.logprobs))
        self._clock.on_tokens(len(chunk.new_token_ids), time.monotonic())
        delta = self._detok.feed(chunk.new_token_ids)
        if chunk.finish_reason is not None or chunk.error:
            self._backend_done = True
            self._metrics.observe_last_chunk(self.request_id, len(self._request.prompt_token_ids), chunk)
            return delta + self._detok.finish() if not chunk.error else delta, True
        if self._detok.stopped:  # the backend missed a stop string the text shows; it is aborted in close()
            return delta + self._detok.finish(), True
        return delta, False

    def _outcome(self, last: GenerationChunk) -> Finished | APIError:
        if last.error:
            return self.fail(from_error_kind(last.error_kind, last.error))
        reason = last.finish_reason if last.finish_reason is not None else "stop"
        self._ended = True
        self._clock.on_success(reason, time.monotonic())
        ask, params = self._request.ask, self._request.params
        usage = Usage(len(self._request.prompt_token_ids), 0 if ask.prompt_only else self._detok.num_tokens,
                      last.cached_tokens, last.cached_tiers)
        logprobs = None
        if params.logprobs is not None:
            logprobs = (*(self._prompt_entries() if ask.echo else ()), *(() if ask.prompt_only else self._logprobs))
        prompt = self._prompt_from.prompt_logprobs if self._prompt_from is not None else self.prompt_logprobs
        text = "" if ask.prompt_only else self._detok.text
        if self._calls:
            assert self._content is not None, "tool calls without tools: _calls set outside _tool_content?"
            reason, text = "tool_calls", output_calls(self._content.ask, text)[0] or ""
        finished = Finished(reason, usage, () if ask.prompt_only else tuple(self._detok.token_ids), text, logprobs,
                            prompt if params.prompt_logprobs is not None or self._prompt_from is not None else None,
                            self._calls)
        self._tell_end(finished)
        return finished

    def fail(self, err: APIError) -> APIError:
        """Count the run as failed with `err`, unless its outcome was already counted."""
        if not self._ended:
            self._ended = True
            self._metrics.failure.labels(kind=err.failure_kind).inc()
        self._tell_end(err)
        return err


def choice_of(text: str, outcome: Finished, request: GenerateRequest, prompt: Sequence[int]) -> Choice:
    """A finished choice's part of a non-streaming body (`prompt`: its own, in a batch)."""
    token_ids = TokenIds(tuple(prompt), outcome.output_token_ids) if request.return_token_ids else None
    shown = None if request.ask.echo_logprobs_only else outcome.prompt_logprobs
    if outcome.tool_calls:
        text = outcome.text
    return Choice(text, outcome.finish_reason, token_ids, outcome.logprobs, tuple(prompt), shown, outcome.tool_calls)


async def sse_frames(run: GenerationRun, shape: ResponseShape, include_usage: bool) -> AsyncGenerator[bytes, None]:
    """The SSE body of a started run (see `responses` for the frame order)."""
    for frame in shape.opening_frames():
        yield frame
    try:
        async for event in run.events():
            if isinstance(event, Delta):
                yield shape.delta_frame(event)
            elif isinstance(event, APIError):
                yield sse_error(event)
            else:
                yield shape.finish_frame(event.finish_reason)
                if include_usage:
                    yield shape.usage_frame(event.usage)
    except Exception as exc:  # noqa: BLE001 - a bug on our side mid-stream: the client still gets a well-formed end
        yield sse_error(run.fail(internal(exc)))
    yield SSE_DONE


class SSEResponse(StreamingResponse):
    """A streaming response that always runs `cleanup` when it ends: finished, failed, or cancelled
    because the client disconnected (starlette then cancels the body mid-iteration)."""

    def __init__(self, frames: AsyncGenerator[bytes, None], cleanup: Callable[[], Awaitable[None]]):
        super().__init__(frames, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._frames = frames  # the body_iterator, kept as the generator it is: closed when the response ends
        self._cleanup = cleanup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._frames.aclose()
                await self._cleanup()


async def unless_disconnected(receive: Receive, work: Callable[[], Awaitable[T]]) -> tuple[bool, T | None]:
    """Run `work()` while watching the client: (True, result), or (False, None) when the client
    disconnected first (then `work` was cancelled). The request body must have been read already."""
    result: list[T] = []

    async def watch(scope: anyio.CancelScope) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        scope.cancel()

    errors: list[Exception] = []
    async with anyio.create_task_group() as group:
        group.start_soon(watch, group.cancel_scope)
        try:
            result.append(await work())
        except Exception as exc:  # noqa: BLE001 - re-raised below as itself, not wrapped in an ExceptionGroup
            errors.append(exc)
        group.cancel_scope.cancel()
    if errors:
        raise errors[0]
    return (True, result[0]) if result else (False, None)
