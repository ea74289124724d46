"""`tandem restart`: a rolling restart of a running `tandem serve`'s workers (`POST /admin/restart`).

Each worker in turn is drained (routed nothing new; its streams move to a peer that decodes, or run
on, at most `--drain-timeout-s`), stopped and started again; clients' streams continue. Prints the
elapsed time while it waits, then what happened to each worker; exit status 1 if any did not restart.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time


def add_restart_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway (default %(default)s)")
    p.add_argument("--workers", help="comma-separated worker ids, in order (default: every worker, prefill first)")
    p.add_argument("--drain-timeout-s", type=float, help="how long a worker's streams may run on before it "
                   "stops; they then resume elsewhere (default: the server's cluster.drain_timeout_s)")
    p.add_argument("--api-key", help="bearer token (default: $TANDEM_API_KEY, else none)")
    p.add_argument("--timeout-s", type=float, default=1800.0,
                   help="give up waiting after this long (default %(default)s)")


def run_restart(args: argparse.Namespace) -> int:
    import httpx

    body: dict = {}
    if args.workers:
        body["workers"] = [w.strip() for w in args.workers.split(",") if w.strip()]
    if args.drain_timeout_s is not None:
        body["drain_timeout_s"] = args.drain_timeout_s
    key = args.api_key or os.environ.get("TANDEM_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    done = threading.Event()
    ticker = threading.Thread(target=_tick, args=(done, time.monotonic()), daemon=True)
    ticker.start()
    try:
        response = httpx.post(args.url.rstrip("/") + "/admin/restart", json=body, headers=headers,
                              timeout=httpx.Timeout(args.timeout_s, connect=10.0))
    except httpx.HTTPError as exc:
        print(f"tandem restart: {args.url}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        done.set()
        ticker.join()
    if response.status_code != 200:
        print(f"tandem restart: HTTP {response.status_code}: {response.text}", file=sys.stderr)
        return 1
    reports = response.json()["restarted"]
    for report in reports:
        print(json.dumps(report))
    return 0 if all(r.get("restarted") for r in reports) else 1


def _tick(done: threading.Event, started: float) -> None:
    """`restarting... Ns` on stderr every 5 s while the server works (a person waits on it)."""
    while not done.wait(5.0):
        print(f"tandem restart: draining and restarting... {time.monotonic() - started:.0f}s", file=sys.stderr,
              flush=True)
