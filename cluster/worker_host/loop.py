"""The loop that hosts one worker, whatever carries its messages (a pipe or in-memory queues) and
whatever its role: it knows only the worker contract (`common.protocol.Worker`).

    worker.start() once (it reported ready: what runs beside serving begins)
    drain the driver's messages -> worker.handle(msg) -> replies sent at once
    worker.step() while worker.busy() -> its messages sent
    a heartbeat with worker.stats() every `heartbeat_interval_s`

Messages go out through the connection (`send_many`: one relay frame per batch once the dispatcher
sent `RelayTo`, `common/relay.py`). An idle worker sleeps until a message or its next heartbeat.

With a core share (`spec.core_share`, CPU workers under `tandem serve`), each step runs on the
threads `cores.ThreadFollower` gives: its own share plus the idle workers' on its node (only its
own, and none lent, while its background compile holds a core: `worker.holds_a_core()`).

A fault while handling a message about one request fails that request (`worker.fail`: its client
gets an "internal" error, what it held is released) and the loop goes on; the engine confines a
fault in a step to its request the same way. Any other exception ends the loop (the host reports it
as `WorkerCrashed`).
"""

from __future__ import annotations

import dataclasses
import time

from cluster.worker_host.build import WorkerSpec
from cluster.worker_host.cores import CoreShare, ThreadFollower
from common import protocol as p
from common.faults import internal_error


def run_loop(spec: WorkerSpec, worker: p.Worker, conn) -> None:
    """Serve `worker` over `conn` until Shutdown; an exception that is no one request's fault ends it."""
    worker.start()
    if spec.core_share is None:
        return _serve(spec, worker, conn, None)
    share = CoreShare(spec.core_share, spec.torch_threads)
    try:
        return _serve(spec, worker, conn, ThreadFollower(share))
    finally:
        share.close()


def _serve(spec: WorkerSpec, worker: p.Worker, conn, threads: ThreadFollower | None) -> None:
    heartbeat_interval_s, last_beat = spec.heartbeat_interval_s, 0.0
    while True:
        if worker.has_compute():
            timeout = 0.0  # compute to do: only drain what is already there
        elif worker.busy():
            timeout = worker.wait_s()  # only transfers/loads in flight: poll them, don't spin a core
        else:  # idle: a message wakes it; else the next heartbeat (and a session reaped that late at most)
            timeout = max(0.0, min(heartbeat_interval_s, last_beat + heartbeat_interval_s - time.monotonic()))
        if threads is not None and timeout:
            threads.before(False, worker.holds_a_core())  # about to wait: lend this worker's threads meanwhile
        while conn.poll(timeout):
            msg = conn.recv()
            if isinstance(msg, p.Shutdown):
                return
            if isinstance(msg, p.RelayTo):  # only a `QueueConn`'s link sends one (`common/relay.py`)
                conn.relay_to(msg)
            else:
                _send_all(conn, _handle_confined(worker, msg))
            timeout = 0.0
        if worker.busy():
            if threads is not None:
                threads.before(worker.has_compute(), worker.holds_a_core())
            _send_all(conn, worker.step())
        now = time.monotonic()
        if now - last_beat >= heartbeat_interval_s:
            stats = worker.stats()
            if threads is not None:
                stats = dataclasses.replace(stats, step_threads=threads.step_threads())
            conn.send(p.Heartbeat(stats))
            last_beat = now


def _handle_confined(worker: p.Worker, msg) -> list:
    """`worker.handle(msg)`, with a fault confined to the request the message is about."""
    try:
        return worker.handle(msg)
    except Exception as exc:  # one request's fault; anything else is re-raised below
        request_id = getattr(msg, "request_id", None)
        if request_id is None:
            raise  # not about one request: the worker's own fault
        replies = worker.fail(msg, internal_error(request_id, exc, type(msg).__name__))
        worker.check_integrity()  # what it held went back cleanly, or the worker must stop
        return replies


def _send_all(conn, msgs: list) -> None:
    conn.send_many(msgs)
