"""A worker running its loop on a thread of the current process, fed through in-memory queues.

The Ray actor (`cluster.serve.actors.WorkerActor`) is a thin shell around one `WorkerHost`; tests can use
a `WorkerHost` directly. The loop is the same as a worker process's (`loop.run_loop`); only
its connection differs:

    dispatcher --deliver(msgs)--> inbox --> loop thread --> outbox --collect(timeout)--> dispatcher
                                               |
                                               +--> latest stats (answered by `heartbeat()`)

`collect` long-polls: it returns as soon as anything is in the outbox, with everything that is
there, so a decode step's tokens for all requests travel in one call, and the per-call cost is
paid once per step rather than once per token.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from cluster.worker_host.build import WorkerSpec, build_worker
from cluster.worker_host.loop import run_loop
from common import protocol as p
from common.relay import RelaySender

log = logging.getLogger("tandem.worker")


class WorkerStopped(RuntimeError):
    pass


class QueueConn:
    """The loop's side (`send`/`poll`/`recv`) and the client's side (`deliver`/`collect`) of one
    worker's message queues. Thread-safe: one condition guards both directions."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._inbox: deque = deque()
        self._outbox: list = []
        self.stats: p.WorkerStats | None = None
        self.stats_unix_s = time.time()  # the loop refreshes it between steps, every heartbeat interval
        self.closed = False
        self._relay: RelaySender | None = None  # the loop thread's alone (`relay_to`, `send_many`)

    # ---- the loop's side ---------------------------------------------------------------------------
    def send(self, msg) -> None:
        with self._cond:
            if isinstance(msg, p.Heartbeat):  # stats are pulled by heartbeat(), not queued
                if msg.stats is not None:
                    self.stats, self.stats_unix_s = msg.stats, time.time()
                return
            if isinstance(msg, p.WorkerCrashed):  # the collect long-poll reports it, then the loop's end
                self._outbox.append(msg)
                self._cond.notify_all()
                return
        self.send_many([msg])

    def send_many(self, msgs: list) -> None:
        """`msgs` (none a heartbeat) in one relay frame, or onto the outbox when there is no relay;
        a relay that fails is dropped and the outbox takes these and every later message."""
        if not msgs:
            return
        relay = self._relay
        if relay is not None:
            try:
                relay.send(msgs)
                return
            except OSError as exc:
                log.warning("the relay to the gateway failed (%s); back to the collect long-poll", exc)
                self._relay = None
                relay.close()
        with self._cond:
            self._outbox.extend(msgs)
            self._cond.notify_all()

    def relay_to(self, msg: p.RelayTo) -> None:
        """Open the relay (`common/relay.py`); the loop thread calls this, and only it sends. When the
        gateway cannot be reached, messages keep going through the outbox."""
        try:
            self._relay = RelaySender(msg.host, msg.port, msg.hello)
        except OSError as exc:
            log.warning("cannot open the relay to %s:%d (%s); tokens go through the collect long-poll",
                        msg.host, msg.port, exc)

    def poll(self, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._inbox or self.closed, timeout) and bool(self._inbox)

    def recv(self):
        with self._cond:
            return self._inbox.popleft()

    # ---- the client's side -------------------------------------------------------------------------
    def deliver(self, msgs: list) -> None:
        with self._cond:
            self._inbox.extend(msgs)
            self._cond.notify_all()

    def collect(self, timeout_s: float) -> list:
        """Everything the loop sent since the last call; waits up to `timeout_s` for the first item.
        Raises `WorkerStopped` once the loop has ended and everything it sent was collected."""
        with self._cond:
            self._cond.wait_for(lambda: self._outbox or self.closed, timeout_s)
            if self.closed and not self._outbox:
                raise WorkerStopped("the worker loop has stopped")
            out, self._outbox = self._outbox, []
            return out

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()
        if self._relay is not None:
            self._relay.close()


@dataclass(frozen=True)
class HostBeat:
    """A worker's answer to the controller's heartbeat call."""

    worker_id: str
    stats: p.WorkerStats | None  # None until the loop has sent its first stats beat
    crashed: str  # the loop's traceback when it died; "" while it runs
    loop_silent_s: float  # since the loop last passed between steps (a hung step grows it)
    draining: bool = False  # the process got SIGTERM: the controller drains it, then stops it


class WorkerHost:
    """Runs a worker's loop on a thread; the constructor returns once that thread has built the
    worker (model, pools, transport), and raises what the build raised. `shutdown` stops the loop,
    then closes the worker and its transport. `build` makes (worker, transport) from the spec; tests
    pass their own (a tiny model, a model that fails on cue).

    The loop thread builds the worker itself, so that one thread of the process runs torch's
    parallel CPU ops (see `docs/design.md`, "One compute thread per worker"): loading the model on the
    constructing thread and stepping on another made every decode step markedly slower.
    """

    def __init__(self, spec: WorkerSpec, worker_id: str, build: Callable[[WorkerSpec], tuple] = build_worker) -> None:
        self.spec, self.worker_id = spec, worker_id
        self.conn = QueueConn()
        self.crashed = ""
        self.draining = False  # set by the process's SIGTERM handler (`cluster.serve.actors`)
        self._build_error: BaseException | None = None
        built = threading.Event()
        self._thread = threading.Thread(target=self._build_and_run, args=(build, built), name=f"tandem-{worker_id}",
                                        daemon=True)
        self._thread.start()
        built.wait()
        if self._build_error is not None:
            self._thread.join()
            raise self._build_error
        self.session = self.transport.session_id

    @property
    def max_request_tokens(self) -> int:
        """Tokens one request may hold here (the worker's context, pool and landing limits)."""
        return self.worker.max_request_tokens()

    def deliver(self, msgs: list) -> None:
        self.conn.deliver(msgs)

    def collect(self, timeout_s: float) -> list:
        return self.conn.collect(timeout_s)

    def heartbeat(self) -> HostBeat:
        return HostBeat(self.worker_id, self.conn.stats, self.crashed, max(0.0, time.time() - self.conn.stats_unix_s),
                        self.draining)

    def shutdown(self, timeout_s: float = 10.0) -> bool:
        """Stop the loop and close the transport. Returns False when the loop did not stop in time
        (then the transport is left open: a step may still be using it)."""
        self.conn.deliver([p.Shutdown()])
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.error("%s: loop did not stop within %.1fs", self.worker_id, timeout_s)
            return False
        self.worker.close()
        self.transport.close()
        self.conn.close()
        return True

    def _build_and_run(self, build: Callable[[WorkerSpec], tuple], built: threading.Event) -> None:
        try:
            self.worker, self.transport = build(self.spec)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the constructor, on its thread
            self._build_error = exc
            return
        finally:
            built.set()
        self._run()

    def _run(self) -> None:
        try:
            run_loop(self.spec, self.worker, self.conn)
        except Exception:  # noqa: BLE001 - the controller sees `crashed` in the next heartbeat and restarts us
            self.crashed = traceback.format_exc()
            log.error("%s crashed:\n%s", self.worker_id, self.crashed)
            self.conn.send(p.WorkerCrashed(self.spec.role, self.crashed))
            self.conn.close()


class HostLink:
    """`router.dispatcher.WorkerLink` to a `WorkerHost` in this process (tests, single-process use)."""

    relays = True  # its `WorkerHost` opens the token relay when told (`common/relay.py`)

    def __init__(self, host: WorkerHost) -> None:
        self.host = host

    async def send(self, msgs: list) -> None:
        self.host.deliver(msgs)

    async def collect(self, timeout_s: float) -> list:
        return await asyncio.to_thread(self.host.collect, timeout_s)
