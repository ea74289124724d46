"""A `router.backend.Backend` over a real `EngineCore`, for gateway tests.

The engine is not thread-safe, so one background thread owns it: it runs commands (add, abort, any
test probe) between steps and steps while requests are unfinished. Each request's outputs go to an
asyncio queue on the loop that called `generate`, so the backend works under any event loop (a test
client's, a uvicorn thread's). Faults are injected by setting attributes:

    fail_start        BackendError raised by the next generate() calls before they yield anything
    fail_after_tokens (n, ErrorKind): after n tokens the request ends with an error chunk
    crash_after_tokens  n: after n tokens the stream raises RuntimeError (a backend bug; the engine
                      request keeps running until someone aborts it)
    start_delay_s     sleep before the request reaches the engine (a slow queue)
    step_delay_s      sleep after every engine step (slow streams)
    ignore_stop_strings  the engine is not told the stop strings (the gateway must cut the text itself)

Streaming sessions as the dispatcher serves them: `open_session` opens one in the engine (a fresh
id; budget full -> QUEUE_FULL, other refusals -> REJECTED), a turn of a session this backend never
opened or already closed raises NOT_FOUND at once, and one the engine refuses (reaped, busy, over
capacity) is REJECTED. `sent` records what each generate() call got: (prompt token ids, session id).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from common.config import SamplingParams
from common.protocol import Failure, WorkerRole
from engine.output import StepOutput
from engine.sessions import SessionError
from router.backend import BackendError, ErrorKind, GenerationChunk, WorkerGauge

WORKER_ID = "engine-0"
IDLE_WAIT_S = 0.05


class EngineBackend:
    model_name = "smollm2"

    def __init__(self, engine: Any, kv_transfer: tuple[int, float] | None = None):
        """`kv_transfer` = (bytes, seconds) reported on every last chunk, as a disaggregated backend would."""
        self.engine, self.tokenizer = engine, engine.tokenizer
        self.max_model_len = engine.scheduler.max_request_tokens()
        self.kv_transfer = kv_transfer
        self.fail_start: BackendError | None = None
        self.fail_after_tokens: tuple[int, ErrorKind] | None = None
        self.crash_after_tokens: int | None = None
        self.start_delay_s = 0.0
        self.step_delay_s = 0.0
        self.ignore_stop_strings = False
        self.abort_calls: list[str] = []
        self.started_ids: list[str] = []
        self.sent: dict[str, tuple[tuple[int, ...], str]] = {}  # request id -> (prompt token ids, session id)
        self.open_sessions: set[str] = set()  # opened here and not closed (the dispatcher's table)
        self.extra_collectors: list[Any] = []
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}  # engine thread only
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="engine-backend", daemon=True)
        self._thread.start()

    # ---- Backend ---------------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       session_id: str = "", follow: str = "") -> AsyncIterator[GenerationChunk]:
        self.sent[request_id] = (tuple(prompt_token_ids), session_id)
        if self.fail_start is not None:
            raise self.fail_start
        if session_id and session_id not in self.open_sessions:
            raise BackendError(ErrorKind.NOT_FOUND, f"session {session_id!r} is not open (closed, or never opened)")
        if self.start_delay_s:
            await asyncio.sleep(self.start_delay_s)
        if self.ignore_stop_strings:
            params = dataclasses.replace(params, stop=())
        outputs: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wrap_future(self._submit(lambda e: self._add(e, request_id, prompt_token_ids, params,
                                                                       session_id, loop, outputs)))
        except ValueError as exc:
            raise BackendError(ErrorKind.REJECTED, str(exc)) from None
        self.started_ids.append(request_id)
        num_tokens = 0
        while True:
            out: StepOutput = await outputs.get()
            num_tokens += len(out.new_token_ids)
            if self.fail_after_tokens is not None and num_tokens >= self.fail_after_tokens[0]:
                self._submit(lambda e: self._drop(e, request_id))
                yield GenerationChunk(tuple(out.new_token_ids), "abort", error="the decode worker died",
                                      error_kind=self.fail_after_tokens[1])
                return
            if self.crash_after_tokens is not None and num_tokens >= self.crash_after_tokens:
                raise RuntimeError("a bug in the backend")
            yield self._chunk(out)
            if out.finish_reason is not None:
                return

    async def abort(self, request_id: str) -> None:
        self.abort_calls.append(request_id)
        await asyncio.wrap_future(self._submit(lambda e: self._drop(e, request_id)))

    async def open_session(self, capacity_tokens: int, idle_timeout_s: float) -> str:
        session_id = f"sess-{uuid.uuid4().hex}"
        try:
            await asyncio.wrap_future(self._submit(lambda e: e.open_session(session_id, capacity_tokens,
                                                                             idle_timeout_s)))
        except SessionError as exc:
            kind = ErrorKind.QUEUE_FULL if "budget full" in str(exc) else ErrorKind.REJECTED
            raise BackendError(kind, str(exc)) from None
        self.open_sessions.add(session_id)
        return session_id

    async def close_session(self, session_id: str) -> bool:
        if session_id not in self.open_sessions:
            return False
        self.open_sessions.discard(session_id)
        await asyncio.wrap_future(self._submit(lambda e: e.close_session(session_id)))
        return True

    def num_requests(self) -> tuple[int, int]:
        return len(self.engine.scheduler.running), len(self.engine.scheduler.waiting)

    def worker_gauges(self) -> list[WorkerGauge]:
        usage = self.engine.kvm.pool.usage()
        running, waiting = self.num_requests()
        l2 = self.engine.host_cache.pool
        l2_usage = 1 - l2.num_free / l2.num_usable if l2 is not None else None
        return [WorkerGauge(WORKER_ID, WorkerRole.COLOCATED, True, running, waiting, usage.private / usage.total, None,
                            0, host_cache_usage=l2_usage, tiers=self.engine.tier_stats(),
                            graphs=self.engine.graph_stats(), spec=self.engine.spec_stats())]

    # ---- test helpers ----------------------------------------------------------------------------
    def on_engine(self, fn: Callable[[Any], Any], timeout_s: float = 60.0) -> Any:
        """Run `fn(engine)` on the engine thread between steps; returns its result."""
        return self._submit(fn).result(timeout_s)

    def wait_idle(self, timeout_s: float = 30.0) -> None:
        """Until no request is in the engine (aborts and finishes have been applied)."""
        deadline = time.monotonic() + timeout_s
        while self.on_engine(lambda e: e.busy() or bool(e.requests)):
            assert time.monotonic() < deadline, "the engine did not go idle"
            time.sleep(IDLE_WAIT_S)

    def reset_faults(self) -> None:
        self.fail_start = self.fail_after_tokens = self.crash_after_tokens = None
        self.start_delay_s = self.step_delay_s = 0.0
        self.ignore_stop_strings = False

    def close(self) -> None:
        self._stopped = True
        self._thread.join(10)

    # ---- engine thread ---------------------------------------------------------------------------
    def _submit(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, future))
        return future

    def _loop(self) -> None:
        while not self._stopped:
            self._run_commands(block=not self.engine.busy())
            if self.engine.busy():
                for out in self.engine.step():
                    self._deliver(out)
                if self.step_delay_s:
                    time.sleep(self.step_delay_s)

    def _run_commands(self, block: bool) -> None:
        try:
            fn, future = self._commands.get(timeout=IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            try:
                future.set_result(fn(self.engine))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, who asked for it
                future.set_exception(exc)
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return

    def _add(self, engine, request_id, prompt_token_ids, params, session_id, loop, outputs) -> None:
        engine.add_request(prompt_token_ids, params, request_id, session_id)
        self._streams[request_id] = (loop, outputs)

    def _drop(self, engine, request_id: str) -> None:
        self._streams.pop(request_id, None)
        engine.abort(request_id)

    def _deliver(self, out: StepOutput) -> None:
        target = self._streams.get(out.request_id)
        if target is None:
            return
        if out.finish_reason is not None:
            del self._streams[out.request_id]
        loop, outputs = target
        try:
            loop.call_soon_threadsafe(outputs.put_nowait, out)
        except RuntimeError:  # that loop is closed: its test is over and nobody reads this stream
            self._streams.pop(out.request_id, None)

    def _chunk(self, out: StepOutput) -> GenerationChunk:
        if out.finish_reason is None:
            return GenerationChunk(tuple(out.new_token_ids), logprobs=out.logprobs, prompt_logprobs=out.prompt_logprobs)
        if out.error:  # as the dispatcher maps a worker's failure (`router.flights.failure_outcome`)
            kind = ErrorKind.REJECTED if out.failure is Failure.REJECTED else ErrorKind.INTERNAL
            return GenerationChunk(tuple(out.new_token_ids), "abort", error=out.error, error_kind=kind)
        transfer_bytes, transfer_s = self.kv_transfer or (0, None)
        return GenerationChunk(tuple(out.new_token_ids), out.finish_reason.value, cached_tokens=out.cached_tokens,
                               kv_transfer_s=transfer_s, kv_transfer_bytes=transfer_bytes,
                               decode_worker=WORKER_ID, logprobs=out.logprobs, prompt_logprobs=out.prompt_logprobs,
                               cached_tiers=out.cached_tiers)


@contextlib.contextmanager
def smollm2_backend(num_pages: int = 128, **kw) -> Iterator[EngineBackend]:
    """An `EngineBackend` over a SmolLM2 engine of `num_pages` (`kw`: the backend's); afterwards its
    faults cleared, idle, its pool at rest, closed."""
    from tests.helpers import assert_pool_at_rest, make_smollm2_engine

    backend = EngineBackend(make_smollm2_engine(num_pages=num_pages), **kw)
    try:
        yield backend
    finally:
        backend.reset_faults()
        backend.wait_idle()
        backend.on_engine(assert_pool_at_rest)
        backend.close()


def settle_backend(request) -> None:
    """Teardown of a test that used the `backend` fixture: faults cleared, idle, pool consistent and
    no request holding KV (private pages)."""
    if "backend" not in request.fixturenames:
        return
    backend = request.getfixturevalue("backend")
    backend.reset_faults()
    backend.wait_idle()
    private = backend.on_engine(lambda e: (e.check_integrity(), e.kvm.pool.usage().private)[1])
    assert private == 0, f"{private} private pages left after the test: a request was not released"
