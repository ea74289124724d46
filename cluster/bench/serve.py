"""`tandem bench serve` and the benches beside it: the `tandem serve` they start, its token relay histogram,
and the offline-engine baseline.

The command and its load harness live in `cluster.bench.load` (`load/runner.py`: any OpenAI-compatible
endpoint, vLLM's flags and result keys). What is here sits below that command and `tandem bench
overload / llamacpp`, which all use it (it imports none of them):

    SpawnedServer / ExistingServer / wait_ready   a server started here on a free port, or one given
    scrape_relay / bucket_quantile                the server's `tandem:token_relay_seconds` histogram,
                                                  diffed across a run and interpolated within buckets
                                                  (only as fine as the bucket edges)
    run_offline                                   the same prompts through `EngineCore.generate` here
                                                  (`--offline-baseline`; run before any server starts)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from cluster.bench.offline import Throughput, Workload, run_tandem

log = logging.getLogger("tandem.bench")

LAPTOP_SETS = ["engine.num_pages=512", "decode.host_pages=512"]  # small pools; later --set wins
# A throughput run at a fixed concurrency, not an overload test (that is `tandem bench overload`):
# the server it starts queues what it is sent instead of refusing it to keep TTFT near unloaded.
QUEUE_ALL_SETS = ["router.max_queue_delay_s=3600", "router.max_queued_requests=100000"]
RELAY = "tandem:token_relay_seconds"
POLLS = "tandem:worker_polls_total"
GENERATION_TOKENS = "tandem:generation_tokens_total"
STOP_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class RelaySnapshot:
    """Cumulative counts of the relay histogram (`le` edge -> count) and the tokens generated."""

    buckets: dict[float, float]
    num_messages: float
    num_tokens: float
    num_polls: float  # batches of decode workers' messages (collect calls or relay frames)

    def minus(self, before: RelaySnapshot) -> RelaySnapshot:
        return RelaySnapshot({le: n - before.buckets.get(le, 0.0) for le, n in self.buckets.items()},
                             self.num_messages - before.num_messages, self.num_tokens - before.num_tokens,
                             self.num_polls - before.num_polls)


# ---- the server --------------------------------------------------------------------------------
class SpawnedServer:
    """`tandem serve` as a child process of this one, on a free port; its output goes to a temp log."""

    def __init__(self, serve_flags: list[str]):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        log_fd, self.log_path = tempfile.mkstemp(prefix="tandem-serve-", suffix=".log")
        cmd = [sys.executable, "-m", "cluster.cli", "serve", "--port", str(port), *serve_flags]
        self.proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[1], stdout=log_fd,
                                     stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                     start_new_session=True)
        os.close(log_fd)  # the child holds its own copy
        log.info("started tandem serve (pid %d) on port %d; its log: %s", self.proc.pid, port, self.log_path)

    def exited_code(self) -> int | None:
        return self.proc.poll()

    def log_tail(self, num_chars: int = 4000) -> str:
        return Path(self.log_path).read_text(errors="replace")[-num_chars:]

    def stop(self) -> int:
        """SIGTERM, wait for it to drain and stop its workers and Ray; SIGKILL the group on timeout."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                log.error("tandem serve did not stop within %.0fs; killing it", STOP_TIMEOUT_S)
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        code = self.proc.returncode
        if code == 0:
            os.unlink(self.log_path)
        else:
            print(f"tandem serve exited with code {code}; its log ends:\n{self.log_tail()}", file=sys.stderr)
        return code


class ExistingServer:
    """`--url`: a server someone else runs; this benchmark neither starts nor stops it."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")

    def exited_code(self) -> int | None:
        return None

    def log_tail(self) -> str:
        return "(not started here)"

    def stop(self) -> int:
        return 0


def exit_cause(code: int) -> str:
    """What a negative exit code (killed by a signal) most likely means, for the error a bench raises."""
    if code >= 0:
        return ""
    try:
        name = signal.Signals(-code).name
    except ValueError:
        return f" (signal {-code})"
    if -code == signal.SIGILL:
        return (f" ({name}: an instruction this CPU lacks; a prebuilt binary was made for another CPU"
                " (e.g. with AVX-512): rebuild it on this machine)")
    return f" ({name})"


READY_POLL_S = 0.2
"""How often a bench asks a starting server whether it is ready."""


def wait_ready(server, headers: dict, timeout_s: float, path: str = "/health/ready",
               name: str = "tandem serve") -> None:
    """Until `server` answers 200 on `path` (polled every `READY_POLL_S`, so a start-to-ready figure is
    that close); raises when its process exits first or time runs out."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        code = server.exited_code()
        if code is not None:
            raise RuntimeError(f"{name} exited with {code}{exit_cause(code)}:\n{server.log_tail()}")
        try:
            if httpx.get(f"{server.url}{path}", headers=headers, timeout=30).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(READY_POLL_S)
    raise TimeoutError(f"{server.url} not ready within {timeout_s:.0f}s:\n{server.log_tail()}")


def wait_warm(server, headers: dict, timeout_s: float) -> float:
    """Until no worker of a ready `tandem serve` still compiles its CPU decode step (it serves from
    ready on, eagerly until then), so a bench times the steady state; the seconds waited. A server
    without `/debug/workers` (not tandem) is taken as warm."""
    import httpx

    start_s = time.monotonic()
    while time.monotonic() - start_s < timeout_s:
        try:
            resp = httpx.get(f"{server.url}/debug/workers", headers=headers, timeout=30)
        except httpx.HTTPError:
            resp = None
        if resp is not None and resp.status_code != 200:
            return 0.0
        workers = resp.json()["workers"] if resp is not None else None
        if workers is not None and all(w["stats"] and not w["stats"]["graphs"]["compiling"] for w in workers):
            waited = time.monotonic() - start_s
            if waited >= 0.5:
                log.info("waited %.1f s after ready for the workers' decode-step compile", waited)
            return waited
        time.sleep(0.25)
    raise TimeoutError(f"{server.url}: a worker still compiles {timeout_s:.0f}s after ready:\n{server.log_tail()}")


# ---- the load ----------------------------------------------------------------------------------

async def sse_frames(resp):
    """The JSON frames of an OpenAI-style SSE stream up to `[DONE]`; an error frame raises."""
    async for line in resp.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        frame = json.loads(line[len("data: "):])
        if "error" in frame:
            raise RuntimeError(f"request failed mid-stream: {frame['error']}")
        yield frame


def scrape_relay(url: str, headers: dict) -> RelaySnapshot:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", headers=headers, timeout=30).text
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    value = {s.name: s.value for s in samples if not s.labels}
    polls = sum(s.value for s in samples if s.name == POLLS and s.labels.get("role") == "decode")
    return RelaySnapshot({float(s.labels["le"]): s.value for s in samples if s.name == RELAY + "_bucket"},
                         value.get(RELAY + "_count", 0.0), value.get(GENERATION_TOKENS, 0.0), polls)


def bucket_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Like Prometheus' histogram_quantile: linear within the bucket holding rank q * total; a rank in
    the +Inf bucket answers the highest finite edge. None for an empty histogram."""
    edges = sorted(buckets)
    total = buckets[edges[-1]] if edges else 0.0
    if total <= 0:
        return None
    rank, lower_edge, lower_count = q * total, 0.0, 0.0
    for edge in edges:
        count = buckets[edge]
        if count >= rank:
            if math.isinf(edge):
                return lower_edge
            return lower_edge + (edge - lower_edge) * (rank - lower_count) / (count - lower_count)
        lower_edge, lower_count = edge, count
    return lower_edge


# ---- the baseline and the whole run --------------------------------------------------------------
def run_offline(engine_config, work: Workload) -> Throughput:
    from common.config import SamplingParams
    from engine import load_engine

    engine = load_engine(engine_config)
    engine.generate([work.prompts[0][:16]], SamplingParams(max_tokens=2))  # warm up
    return dataclasses.replace(run_tandem(engine, work), system="offline")


def serve_flags(args: argparse.Namespace, defaults: tuple[str, ...] = ()) -> list[str]:
    """`tandem serve` flags of a server started here: small pools, `defaults`, then the user's --set."""
    sets = [*LAPTOP_SETS, *defaults, *args.set] if args.url is None else list(args.set)
    return [*(["--config", args.config] if args.config else []), *(f for s in sets for f in ("--set", s))]


def load_config(flags: list[str]):
    """The server's config as `tandem serve` would build it from the same flags (the baseline's engine)."""
    from cluster.serve.config_load import add_serve_args, serve_config_from_args

    parser = argparse.ArgumentParser(prog="tandem bench serve")
    add_serve_args(parser)
    return serve_config_from_args(parser.parse_args(flags))
