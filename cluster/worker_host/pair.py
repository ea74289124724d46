"""Driver of one prefill and one decode worker process (disaggregated mode without Ray).

It plays the router's role for a single pair: reserve a landing on the decode worker, hand the
request to the prefill worker, relay their messages, and collect tokens. It watches both workers:
a process that exits, crashes or misses heartbeats for `heartbeat_timeout_s` is dead; the survivor
is told (`PeerDead`) and releases what it shared with it, the requests it held end with a typed
error, and, if the prefill worker is the one gone, new requests are served by the decode worker
alone (local prefill).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import multiprocessing as mp
import time
from collections import deque
from dataclasses import dataclass, field

from cluster import protocol as p
from cluster.config import EngineConfig, SamplingParams
from cluster.worker_host.build import WorkerSpec
from cluster.worker_host.process import worker_main
from kv_store.transfer.config import TransportConfig

log = logging.getLogger("tandem.pair")

PREFILL_ID = "prefill-0"


class RequestFailure(enum.Enum):
    """Typed reason a request ended without the client asking."""

    TRANSFER = "transfer_error"  # the KV transfer failed, timed out, or its peer died
    WORKER_DIED = "worker_died"
    REJECTED = "rejected"  # can never be served (too long, bad tokens)


@dataclass
class PairRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    failure: RequestFailure | None = None
    error: str = ""
    submitted_at: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    cached_tokens: int = 0
    timings: dict = field(default_factory=dict)  # worker-side monotonic timestamps (same host)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclass
class _Worker:
    role: str
    spec: WorkerSpec
    process: mp.Process
    conn: object
    session: str = ""
    last_heartbeat: float = field(default_factory=time.monotonic)
    last_stats: float = 0.0
    stats: p.WorkerStats | None = None
    alive: bool = True


class ProcessPair:
    """Not thread-safe: one caller drives `pump`/`generate`."""

    def __init__(self, engine: EngineConfig, host_pages: int = 4096, deadlines=None,
                 heartbeat_interval_s: float = 0.5, heartbeat_timeout_s: float = 10.0, start_timeout_s: float = 300.0):
        self.heartbeat_timeout_s = heartbeat_timeout_s
        ctx = mp.get_context("spawn")
        self.workers: dict[str, _Worker] = {}
        for role in ("prefill", "decode"):
            transport = TransportConfig(**dataclasses.asdict(deadlines)) if deadlines else TransportConfig()
            spec = WorkerSpec(role, engine, host_pages=host_pages if role == "decode" else 0, transport=transport,
                              heartbeat_interval_s=heartbeat_interval_s)
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(spec, child), name=f"tandem-{role}", daemon=True)
            proc.start()
            child.close()
            self.workers[role] = _Worker(role, spec, proc, parent)
        self.requests: dict[str, PairRequest] = {}
        self._queue: deque[str] = deque()  # waiting for a landing
        self._reserving: set[str] = set()
        self._digests: dict[str, p.KVDigest] = {}
        self._wait_ready(start_timeout_s)

    # ---- requests ----------------------------------------------------------------------------------
    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> PairRequest:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        req = PairRequest(request_id, list(prompt_token_ids), params)
        self.requests[request_id] = req
        if not self.workers["decode"].alive:
            self._fail(req, RequestFailure.WORKER_DIED, "the decode worker is not running")
        elif self.workers["prefill"].alive:
            self._queue.append(request_id)
        else:
            self._send("decode", p.Generate(request_id, tuple(prompt_token_ids), params))
        return req

    def abort(self, request_id: str) -> None:
        req = self.requests[request_id]
        if req.done:
            return
        req.finish_reason = "abort"
        if request_id in self._queue:
            self._queue.remove(request_id)
        else:
            self._send("decode", p.Abort(request_id))

    def busy(self) -> bool:
        return any(not r.done for r in self.requests.values())

    def generate(self, prompts: list[list[int]], params: SamplingParams, timeout_s: float = 600.0) -> list[PairRequest]:
        base = len(self.requests)
        reqs = [self.submit(f"req-{base + i}", prompt, params) for i, prompt in enumerate(prompts)]
        deadline = time.monotonic() + timeout_s
        while any(not r.done for r in reqs):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{sum(not r.done for r in reqs)} requests unfinished after {timeout_s}s")
            self.pump(0.05)
        return reqs

    # ---- the pump ----------------------------------------------------------------------------------
    def pump(self, timeout_s: float = 0.05) -> None:
        """Deliver every message that arrives within `timeout_s`; dispatch queued requests; check liveness."""
        self._dispatch()
        conns = {w.conn: w for w in self.workers.values() if w.alive}
        for conn in mp.connection.wait(list(conns), timeout=timeout_s):
            worker = conns[conn]
            try:
                while worker.alive and conn.poll():
                    self._on_message(worker, conn.recv())
            except (EOFError, OSError):
                self._declare_dead(worker, "its pipe closed")
        self._check_liveness()

    def stats(self, role: str, fresh_within_s: float = 5.0) -> p.WorkerStats:
        """The latest heartbeat stats of `role`, waiting for one newer than now."""
        asked = time.monotonic()
        worker = self.workers[role]
        while worker.last_stats < asked:
            if time.monotonic() - asked > fresh_within_s or not worker.alive:
                raise TimeoutError(f"no heartbeat from {role} within {fresh_within_s}s")
            self.pump(0.05)
        return worker.stats

    def kv_digest(self, role: str, token_ids: list[int], num_pages: int, timeout_s: float = 30.0) -> p.KVDigest:
        """Hash of `role`'s cached KV for the first `num_pages` pages of `token_ids` (debug hook)."""
        self._digests.pop(role, None)
        self._send(role, p.DigestKV(tuple(token_ids), num_pages))
        deadline = time.monotonic() + timeout_s
        while role not in self._digests:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no KV digest from {role} within {timeout_s}s")
            self.pump(0.05)
        return self._digests.pop(role)

    def kill(self, role: str) -> None:
        """Test hook: SIGKILL a worker process (no goodbye)."""
        self.workers[role].process.kill()

    def stall(self, role: str, seconds: float) -> None:
        """Test hook: the worker stops stepping for `seconds`."""
        self._send(role, p.Stall(seconds))

    def close(self, timeout_s: float = 10.0) -> None:
        for w in self.workers.values():
            if w.alive:
                self._send(w.role, p.Shutdown())
        for w in self.workers.values():
            w.process.join(timeout_s)
            if w.process.is_alive():
                w.process.kill()
                w.process.join(5)
            w.conn.close()

    # ---- internals ---------------------------------------------------------------------------------
    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while any(not w.session for w in self.workers.values()):
            for w in self.workers.values():
                if not w.session and w.conn.poll(0.1):
                    try:
                        msg = w.conn.recv()
                    except EOFError:
                        msg = p.WorkerCrashed(w.role, f"exited during start (code {w.process.exitcode})")
                    if isinstance(msg, p.WorkerCrashed):
                        self.close()
                        raise RuntimeError(f"{w.role} worker failed to start:\n{msg.error}")
                    if isinstance(msg, p.WorkerReady):
                        w.session, w.last_heartbeat = msg.session, time.monotonic()
                if not w.process.is_alive() and not w.session:
                    self.close()
                    raise RuntimeError(f"{w.role} worker exited during start (code {w.process.exitcode})")
            if time.monotonic() > deadline:
                self.close()
                raise TimeoutError(f"workers not ready within {timeout_s}s")

    def _dispatch(self) -> None:
        while self._queue and len(self._reserving) < 64:
            rid = self._queue.popleft()
            req = self.requests[rid]
            self._reserving.add(rid)
            self._send("decode", p.Reserve(rid, tuple(req.prompt_token_ids), req.params, PREFILL_ID))

    def _on_message(self, worker: _Worker, msg) -> None:
        if isinstance(msg, p.Heartbeat):
            worker.last_heartbeat = time.monotonic()
            if msg.stats is not None:
                worker.last_stats, worker.stats = worker.last_heartbeat, msg.stats
        elif isinstance(msg, p.TokenOutput):
            self._on_tokens(msg)
        elif isinstance(msg, p.Reserved):
            self._on_reserved(msg)
        elif isinstance(msg, (p.KVProgress, p.KVComplete, p.TransferAborted)):
            self._send("decode", msg)
        elif isinstance(msg, p.AbortTransfer):
            self._send("prefill", msg)
        elif isinstance(msg, p.KVDigest):
            self._digests[worker.role] = msg
        elif isinstance(msg, p.WorkerCrashed):
            self._declare_dead(worker, f"crashed:\n{msg.error}")
        else:
            log.warning("unexpected message from %s: %r", worker.role, msg)

    def _on_reserved(self, msg: p.Reserved) -> None:
        self._reserving.discard(msg.request_id)
        req = self.requests[msg.request_id]
        if msg.error:
            self._fail(req, RequestFailure.REJECTED, msg.error)
        elif req.done:  # aborted while reserving: the decode worker already dropped it
            pass
        elif msg.landing is None:
            self._queue.appendleft(msg.request_id)  # host tier full: retry
        elif not self.workers["prefill"].alive:
            self._send("decode", p.PeerDead(PREFILL_ID))
        else:
            self._send("prefill", p.Prefill(req.request_id, tuple(req.prompt_token_ids), req.params, msg.landing))

    def _on_tokens(self, msg: p.TokenOutput) -> None:
        req = self.requests.get(msg.request_id)
        if req is None or req.done:
            return
        if msg.new_token_ids and req.first_token_at is None:
            req.first_token_at = time.monotonic()
        req.token_ids += msg.new_token_ids
        if msg.finish_reason is not None:
            req.finish_reason, req.error = msg.finish_reason, msg.error
            req.cached_tokens, req.timings = msg.cached_tokens, dict(msg.timings)
            if msg.error:
                req.failure = RequestFailure.TRANSFER

    def _check_liveness(self) -> None:
        now = time.monotonic()
        for w in self.workers.values():
            if not w.alive:
                continue
            if not w.process.is_alive():
                self._declare_dead(w, f"its process exited (code {w.process.exitcode})")
            elif now - w.last_heartbeat > self.heartbeat_timeout_s:
                self._declare_dead(w, f"no heartbeat for {now - w.last_heartbeat:.1f}s")

    def _declare_dead(self, worker: _Worker, why: str) -> None:
        if not worker.alive:
            return
        worker.alive = False
        log.error("%s worker is dead: %s", worker.role, why)
        if worker.process.is_alive():
            worker.process.kill()
        if worker.role == "decode":
            for req in self.requests.values():
                if not req.done:
                    self._fail(req, RequestFailure.WORKER_DIED, f"decode worker died: {why}")
            self._queue.clear()
            self._send("prefill", p.PeerDead(worker.session))
        else:
            self._send("decode", p.PeerDead(PREFILL_ID))
            for rid in list(self._queue):  # not yet reserved: serve them on the decode worker alone
                req = self.requests[rid]
                self._send("decode", p.Generate(rid, tuple(req.prompt_token_ids), req.params))
            self._queue.clear()

    def _fail(self, req: PairRequest, failure: RequestFailure, error: str) -> None:
        req.finish_reason, req.failure, req.error = "abort", failure, error

    def _send(self, role: str, msg) -> None:
        worker = self.workers[role]
        if not worker.alive:
            return
        try:
            worker.conn.send(msg)
        except (BrokenPipeError, OSError):
            self._declare_dead(worker, "its pipe broke")
