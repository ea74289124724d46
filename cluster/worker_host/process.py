"""A worker in its own OS process (spawned), driven over a pipe: the entry point and its heartbeat
thread. Any exception that ends the loop is reported as `WorkerCrashed` before the process exits."""

from __future__ import annotations

import logging
import os
import threading
import traceback

from cluster import protocol as p
from cluster.worker_host.build import WorkerSpec, build_worker
from cluster.worker_host.loop import run_loop


class _LockedConn:
    """The pipe shared by the loop and the beat thread: sends are serialised."""

    def __init__(self, conn):
        self._conn, self._lock = conn, threading.Lock()

    def send(self, msg) -> None:
        with self._lock:
            self._conn.send(msg)

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


def worker_main(spec: WorkerSpec, raw_conn) -> None:
    """Process entry point (spawn). Runs until Shutdown or the pipe closes."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {spec.role}[{os.getpid()}] %(message)s")
    conn, stop = _LockedConn(raw_conn), threading.Event()
    try:
        worker, transport = build_worker(spec)
        conn.send(p.WorkerReady(spec.role, transport.session_id))
        threading.Thread(target=_beat_forever, args=(conn, spec.heartbeat_interval_s, stop), daemon=True).start()
        run_loop(spec, worker, conn)
        stop.set()
        worker.close()
        transport.close()
    except (EOFError, BrokenPipeError):
        pass
    except Exception:  # report, then die: the driver restarts or fails over
        try:
            conn.send(p.WorkerCrashed(spec.role, traceback.format_exc()))
        except (EOFError, BrokenPipeError, OSError):
            pass
        raise
