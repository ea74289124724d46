"""Workers in their own OS processes (spawned), driven over a pipe, without Ray.

The child's side: `worker_main` (the entry point) and its heartbeat thread; any exception that
ends the loop is reported as `WorkerCrashed` before the process exits.

The parent's side: `ProcessViews` spawns the workers and is the dispatcher's `ViewSource`; each
worker is reached through a `PipeLink` (the dispatcher's `WorkerLink`). The relay itself is
`router.dispatcher.Dispatcher`, the same one `tandem serve` runs:

    Dispatcher --PipeLink.send--> pipe --> worker_main: run_loop
    Dispatcher <--PipeLink.collect-- inbox <-- reader thread <-- pipe
                                                  |
                                                  +--> heartbeats (liveness, stats), messages set aside

`death_cause` (`liveness.py`) is the one rule that declares a worker dead, here and in the Ray controller.
"""

from __future__ import annotations

import asyncio
import logging
import math
import multiprocessing as mp
import os
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from cluster.worker_host.build import WorkerSpec, build_worker
from cluster.worker_host.liveness import death_cause
from cluster.worker_host.loop import run_loop
from common import protocol as p

log = logging.getLogger("tandem.process")


# ---- the child's side ------------------------------------------------------------------------------


class _LockedConn:
    """The pipe shared by the loop and the beat thread: sends are serialised."""

    def __init__(self, conn):
        self._conn, self._lock = conn, threading.Lock()

    def send(self, msg) -> None:
        with self._lock:
            self._conn.send(msg)

    def send_many(self, msgs: list) -> None:
        for msg in msgs:
            self.send(msg)

    def poll(self, timeout: float) -> bool:
        return self._conn.poll(timeout)

    def recv(self):
        return self._conn.recv()


def _beat_forever(conn: _LockedConn, interval_s: float, stop: threading.Event) -> None:
    """Liveness beats even while a long step runs (a 512-token chunk at 8k context can take
    many seconds on a CPU); the loop adds stats beats between steps."""
    while not stop.wait(interval_s):
        try:
            conn.send(p.Heartbeat(None))
        except (BrokenPipeError, OSError):
            return


def worker_main(spec: WorkerSpec, raw_conn, build: Callable[[WorkerSpec], tuple] = build_worker) -> None:
    """Process entry point (spawn). Runs until Shutdown or the pipe closes. `build` makes
    (worker, transport) from the spec; it must be a picklable top-level function."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {spec.role}[{os.getpid()}] %(message)s")
    conn, stop = _LockedConn(raw_conn), threading.Event()
    try:
        worker, transport = build(spec)
        conn.send(p.WorkerReady(spec.role, transport.session_id))
        threading.Thread(target=_beat_forever, args=(conn, spec.heartbeat_interval_s, stop), daemon=True).start()
        run_loop(spec, worker, conn)
        stop.set()
        worker.close()
        transport.close()
    except (EOFError, BrokenPipeError):
        pass
    except Exception:  # report, then die: the driver fails over
        try:
            conn.send(p.WorkerCrashed(spec.role, traceback.format_exc()))
        except (EOFError, BrokenPipeError, OSError):
            pass
        raise


# ---- the parent's side -----------------------------------------------------------------------------


class PipeLink:
    """`router.workers.WorkerLink` over the parent's end of a worker's spawn pipe.

    A reader thread receives everything the worker sends: heartbeats update `last_beat_s` and
    `stats`; messages `aside(msg)` picks (a test wrapper's replies, say) wait for `take_aside`;
    everything else waits for `collect`. Sends are serialised by a lock (the dispatcher's sender and
    other senders share the pipe).
    """

    relays = False  # messages come back through the pipe only

    def __init__(self, conn, name: str, aside: Callable[[object], bool] | None = None) -> None:
        self._conn, self._send_lock, self._cond = conn, threading.Lock(), threading.Condition()
        self._inbox: list = []
        self._aside = aside
        self._set_aside: list[object] = []  # what `aside` picked, for `take_aside`
        self.closed = False  # the pipe ended: the process is gone
        self._interrupts = 0  # collects cancelled so far (`collect`)
        self.crashed = ""  # the traceback of its WorkerCrashed, if it sent one
        self.last_beat_s = self.last_step_s = time.monotonic()
        self.stats: p.WorkerStats | None = None
        threading.Thread(target=self._read_forever, name=f"pipe-{name}", daemon=True).start()

    async def send(self, msgs: list) -> None:
        await asyncio.to_thread(self.send_now, msgs)

    def send_now(self, msgs: list) -> None:
        """Blocking send (raises BrokenPipeError/OSError once the process is gone)."""
        with self._send_lock:
            for msg in msgs:
                self._conn.send(msg)

    async def collect(self, timeout_s: float) -> list:
        seen = self._interrupts
        try:
            return await asyncio.to_thread(self._collect, timeout_s, seen)
        except asyncio.CancelledError:  # wake its thread, or closing the event loop waits out the timeout
            with self._cond:
                self._interrupts += 1
                self._cond.notify_all()
            raise

    async def take_aside(self, timeout_s: float = 30.0):
        """The oldest message set aside (see `aside`), waiting up to `timeout_s` for one."""
        return await asyncio.to_thread(self._take_aside, timeout_s)

    def _take_aside(self, timeout_s: float):
        with self._cond:
            if not self._cond.wait_for(lambda: self._set_aside or self.closed, timeout_s) or not self._set_aside:
                raise TimeoutError(f"nothing set aside within {timeout_s}s")
            return self._set_aside.pop(0)

    def _collect(self, timeout_s: float, seen: int) -> list:
        with self._cond:
            self._cond.wait_for(lambda: self._inbox or self.closed or self._interrupts != seen, timeout_s)
            if self._interrupts != seen:  # its caller was cancelled: leave the messages to the next
                return []
            if self.closed and not self._inbox:
                raise ConnectionError("the worker's pipe closed")
            out, self._inbox = self._inbox, []
            return out

    def _read_forever(self) -> None:
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                break
            with self._cond:
                self._take(msg, time.monotonic())
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def _take(self, msg, now: float) -> None:
        """Sort one message from the worker (under the condition's lock)."""
        if isinstance(msg, p.Heartbeat):
            self.last_beat_s = now
            if msg.stats is not None:  # sent by the loop between steps
                self.stats, self.last_step_s = msg.stats, now
            return
        if self._aside is not None and self._aside(msg):
            self._set_aside.append(msg)
            self._cond.notify_all()
            return
        if isinstance(msg, p.WorkerCrashed):
            self.crashed = msg.error
        self._inbox.append(msg)
        self._cond.notify_all()


@dataclass(eq=False)
class _Proc:
    worker_id: str
    spec: WorkerSpec
    process: BaseProcess
    conn: Connection  # the parent's end of the pipe
    link: PipeLink | None = None  # set once it is ready
    session: str = ""  # its transport session, from WorkerReady
    dead: str = ""  # why it was declared dead; "" while alive

    def ready_link(self) -> PipeLink:
        """Its link: every worker has one once `ProcessViews` is made (`_wait_ready`)."""
        assert self.link is not None, f"{self.worker_id} has no link yet: used before it sent WorkerReady?"
        return self.link


class ProcessViews:
    """`router.workers.ViewSource` over worker processes it spawns (`specs`: worker id -> spec),
    each one incarnation: nothing restarts them. The constructor returns once every worker sent
    `WorkerReady` (or raises, with every process stopped). `workers()` applies `death_cause` and
    kills a worker it finds dead; the dispatcher then fails over as under `tandem serve`. Close
    with `close()` (or use it as a context manager)."""

    def __init__(self, specs: dict[str, WorkerSpec], *, build: Callable[[WorkerSpec], tuple] = build_worker,
                 aside: Callable[[object], bool] | None = None, heartbeat_timeout_s: float = 10.0,
                 step_timeout_s: float = math.inf, start_timeout_s: float = 300.0):
        self.heartbeat_timeout_s, self.step_timeout_s, self._aside = heartbeat_timeout_s, step_timeout_s, aside
        ctx = mp.get_context("spawn")
        self.procs: dict[str, _Proc] = {}
        for worker_id, spec in specs.items():
            parent, child = ctx.Pipe()
            # a worker over ranks spawns them, which a daemonic process may not (it ends with its pipe)
            proc = ctx.Process(target=worker_main, args=(spec, child, build), name=f"tandem-{worker_id}",
                               daemon=spec.engine.tensor_parallel_size == 1)
            proc.start()
            child.close()
            self.procs[worker_id] = _Proc(worker_id, spec, proc, parent)
        try:
            self._wait_ready(start_timeout_s)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> ProcessViews:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    async def workers(self) -> list:
        from router.workers import WorkerInfo

        return [WorkerInfo(w.worker_id, w.spec.role, 1, not self._check(w), w.session, w.ready_link().stats, 0,
                           w.ready_link(), pid=w.process.pid or 0) for w in self.procs.values()]

    def link(self, worker_id: str) -> PipeLink:
        return self.procs[worker_id].ready_link()

    def kill(self, worker_id: str) -> None:
        """Test hook: SIGKILL the worker's process (no goodbye)."""
        self.procs[worker_id].process.kill()

    async def stats(self, worker_id: str, fresh_within_s: float = 5.0) -> p.WorkerStats:
        """Its first stats heartbeat sent after this call (pool usage, integrity)."""
        asked, link = time.monotonic(), self.link(worker_id)
        while link.last_step_s < asked:
            if time.monotonic() - asked > fresh_within_s or link.closed:
                raise TimeoutError(f"no stats heartbeat from {worker_id} within {fresh_within_s}s")
            await asyncio.sleep(0.02)
        assert link.stats is not None, "a beat that moved last_step_s carries stats (`PipeLink._take`)"
        return link.stats

    def close(self, timeout_s: float = 10.0) -> None:
        """Ask every live worker to stop, then kill what has not stopped within `timeout_s`."""
        for w in self.procs.values():
            if w.link is not None and w.process.is_alive():
                try:
                    w.link.send_now([p.Shutdown()])
                except OSError:
                    pass
        for w in self.procs.values():
            w.process.join(timeout_s)
            if w.process.is_alive():
                w.process.kill()
                w.process.join(5)
            w.conn.close()

    def _check(self, w: _Proc) -> str:
        """Why `w` is dead ("" while alive); a worker found dead is killed, once."""
        if not w.dead:
            now, link = time.monotonic(), w.ready_link()
            w.dead = death_cause(crashed=link.crashed, exit_code=w.process.exitcode,
                                 beat_age_s=now - link.last_beat_s, beat_timeout_s=self.heartbeat_timeout_s,
                                 step_age_s=now - link.last_step_s, step_timeout_s=self.step_timeout_s)
            if w.dead:
                log.error("%s is dead: %s", w.worker_id, w.dead)
                w.process.kill()
        return w.dead

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while any(w.link is None for w in self.procs.values()):
            for w in self.procs.values():
                if w.link is None and w.conn.poll(0.1):
                    self._on_start_message(w)
                if w.link is None and not w.process.is_alive() and not w.conn.poll(0):
                    raise RuntimeError(f"{w.worker_id} exited during start (code {w.process.exitcode})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers not ready within {timeout_s}s")

    def _on_start_message(self, w: _Proc) -> None:
        try:
            msg = w.conn.recv()
        except EOFError:
            msg = p.WorkerCrashed(w.spec.role, f"exited during start (code {w.process.exitcode})")
        if isinstance(msg, p.WorkerCrashed):
            raise RuntimeError(f"{w.worker_id} failed to start:\n{msg.error}")
        if isinstance(msg, p.WorkerReady):
            w.session, w.link = msg.session, PipeLink(w.conn, w.worker_id, self._aside)


# ---- offline use: one prefill and one decode process, the dispatcher in front -----------------------


def pair_specs(engine, decode_engine, host_pages: int, transport=None,
               heartbeat_interval_s: float = 0.5) -> dict[str, WorkerSpec]:
    """"prefill-0" on `engine` and "decode-0" on `decode_engine` (None: `engine`; `transport`: a
    `TransportConfig`, default loopback TCP)."""
    from kv_store.transfer.config import TransportConfig

    transport, beat_s = transport or TransportConfig(), heartbeat_interval_s
    return {"prefill-0": WorkerSpec(p.WorkerRole.PREFILL, engine, transport=transport, heartbeat_interval_s=beat_s),
            "decode-0": WorkerSpec(p.WorkerRole.DECODE, decode_engine or engine, host_pages=host_pages,
                                   transport=transport, heartbeat_interval_s=beat_s)}


@dataclass
class Completion:
    """One request served to its end, as an offline caller sees it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    error: str = ""  # non-empty: it failed (then finish_reason is "abort")
    cached_tokens: int = 0
    timings: dict = field(default_factory=dict)  # the finishing worker's monotonic timestamps (same host)
    submitted_s: float = 0.0  # time.monotonic() when it was handed to the dispatcher
    first_token_s: float | None = None  # time.monotonic() when its first token arrived


async def complete(dispatcher, request_id: str, prompt: list[int], params) -> Completion:
    """Serve one request through `dispatcher` to its last chunk; a refusal is a failed Completion."""
    from router.backend import BackendError

    done = Completion(request_id, list(prompt), submitted_s=time.monotonic())
    try:
        stream = dispatcher.generate(request_id, prompt, params)
    except BackendError as exc:
        done.finish_reason, done.error = "abort", exc.message
        return done
    async for chunk in stream:
        if chunk.new_token_ids and done.first_token_s is None:
            done.first_token_s = time.monotonic()
        done.token_ids += chunk.new_token_ids
        if chunk.finish_reason is not None:
            done.finish_reason, done.error = chunk.finish_reason, chunk.error
            done.cached_tokens, done.timings = chunk.cached_tokens, dict(chunk.timings)
    return done


def offline_dispatcher(views, num_requests: int, max_model_len: int, **kw):
    """A dispatcher for an offline run of `num_requests`: it has no client to refuse, so admission
    queues everything (the prefill window still paces the reservations, as under `tandem serve`), and
    no dead worker restarts, so none of its streams waits for one (`router.migration`)."""
    from router.admission import AdmissionParams
    from router.dispatcher import Dispatcher, DispatcherConfig
    from router.migration import MigrationParams

    n = max(1, num_requests)
    admission = AdmissionParams(max_queue_delay_s=1e9, max_queued_requests=n, max_requests_per_worker=n)
    return Dispatcher.build(views, DispatcherConfig(model_name="offline", max_model_len=max_model_len, max_pending=n,
                            admission=admission, **{"migration": MigrationParams(max_migrations=0), **kw}))


async def serve_prompts(views, prompts: list[list[int]], params, *, id_prefix: str = "req", max_model_len: int = 0,
                        on_finish: Callable[[Completion], None] | None = None, **kw) -> list[Completion]:
    """Serve every prompt through a fresh dispatcher over `views`, all at once; results in order."""
    dispatcher = offline_dispatcher(views, len(prompts), max_model_len, **kw)
    await dispatcher.start()

    async def one(i: int, prompt: list[int]) -> Completion:
        done = await complete(dispatcher, f"{id_prefix}-{i}", prompt, params)
        if on_finish is not None:
            on_finish(done)
        return done

    try:
        return list(await asyncio.gather(*(one(i, prompt) for i, prompt in enumerate(prompts))))
    finally:
        await dispatcher.close()
