"""`tandem bench serve`: a load test of the HTTP serving path, measured against the offline engine.

    offline:  the same prompts and output lengths through `EngineCore.generate` in this process,
              at most `--concurrency` running (no HTTP, no Ray, no prefill -> decode hop)
    served:   `--concurrency` streaming /v1/completions requests in flight at once against a
              `tandem serve` started here (or `--url`); TTFT, gaps between streamed text frames, e2e

The two never run at the same time: the baseline runs before the server starts. The token relay
latency (worker -> gateway) comes from the server's `tandem:token_relay_seconds` histogram, diffed
across the run and interpolated within buckets, so it is only as fine as the bucket edges.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
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

import numpy as np
import torch

from cluster.bench.offline import Throughput, Workload, make_workload, run_tandem

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
class RequestTiming:
    ttft_s: float
    frame_gaps_s: tuple[float, ...]  # between consecutive non-empty text frames
    e2e_s: float
    output_tokens: int


@dataclass(frozen=True)
class RelaySnapshot:
    """Cumulative counts of the relay histogram (`le` edge -> count) and the tokens generated."""

    buckets: dict[float, float]
    num_messages: float
    num_tokens: float
    num_polls: float  # collect calls to decode workers that returned messages

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


def wait_ready(server, headers: dict, timeout_s: float, path: str = "/health/ready", name: str = "tandem serve") -> None:
    """Until `server` answers 200 on `path`; raises when its process exits first or time runs out."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.exited_code() is not None:
            raise RuntimeError(f"{name} exited with {server.exited_code()}:\n{server.log_tail()}")
        try:
            if httpx.get(f"{server.url}{path}", headers=headers, timeout=30).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{server.url} not ready within {timeout_s:.0f}s:\n{server.log_tail()}")


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

async def stream_one(client, prompt: list[int], output_len: int, headers: dict) -> RequestTiming:
    body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    frame_times_s, output_tokens = [], None
    start_s = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body, headers=headers) as resp:
        if resp.status_code == 429:
            raise RuntimeError(f"the server refused a request (429): {(await resp.aread())[:300]!r}; "
                               "lower --concurrency, or serve with a larger router.max_queue_delay_s")
        if resp.status_code != 200:
            raise RuntimeError(f"/v1/completions answered {resp.status_code}: {(await resp.aread())[:500]!r}")
        async for frame in sse_frames(resp):
            if frame.get("usage"):
                output_tokens = frame["usage"]["completion_tokens"]
            if any(choice.get("text") for choice in frame.get("choices", ())):
                frame_times_s.append(time.perf_counter())
    end_s = time.perf_counter()
    assert output_tokens == output_len, f"asked for {output_len} tokens, got {output_tokens}: was ignore_eos dropped?"
    first_s = frame_times_s[0] if frame_times_s else end_s
    return RequestTiming(first_s - start_s, tuple(np.diff(frame_times_s)), end_s - start_s, output_tokens)


async def run_load(url: str, work: Workload, concurrency: int, headers: dict) -> tuple[Throughput, list]:
    """Closed loop: `concurrency` clients, each sending its next request when the last one ended."""
    import httpx

    timings: list[RequestTiming | None] = [None] * len(work.prompts)
    pending = iter(range(len(work.prompts)))  # shared by the clients; one loop thread, so no lock

    async def client_loop(client) -> None:
        for i in pending:
            timings[i] = await stream_one(client, work.prompts[i], work.output_lens[i], headers)

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(None), limits=limits) as client:
        start_s = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        elapsed_s = time.perf_counter() - start_s
    return Throughput("served", elapsed_s, sum(t.output_tokens for t in timings)), timings


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
    from cluster.config import SamplingParams
    from prefill_worker.engine import EngineCore, load_engine

    engine = load_engine(engine_config)
    engine.generate([work.prompts[0][:16]], SamplingParams(max_tokens=2))  # warm up
    return dataclasses.replace(run_tandem(engine, work), system="offline")


def serve_flags(args: argparse.Namespace, defaults: tuple[str, ...] = ()) -> list[str]:
    """`tandem serve` flags of a server started here: small pools, `defaults`, then the user's --set."""
    sets = [*LAPTOP_SETS, *defaults, *args.set] if args.url is None else list(args.set)
    return [*(["--config", args.config] if args.config else []), *(f for s in sets for f in ("--set", s))]


def load_config(flags: list[str]):
    """The server's config as `tandem serve` would build it from the same flags (the baseline's engine)."""
    from cluster.serve.config import add_serve_args, serve_config_from_args

    parser = argparse.ArgumentParser(prog="tandem bench serve")
    add_serve_args(parser)
    return serve_config_from_args(parser.parse_args(flags))


def measure_served(server, work: Workload, concurrency: int, ready_timeout_s: float):
    """(throughput, per-request timings, relay histogram and tokens of the measured requests only)."""
    key = os.environ.get("TANDEM_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    wait_ready(server, headers, ready_timeout_s)
    asyncio.run(run_load(server.url, Workload([work.prompts[0][:16]], [4]), 1, headers))  # first-call costs
    before = scrape_relay(server.url, headers)
    served, timings = asyncio.run(run_load(server.url, work, concurrency, headers))
    return served, timings, scrape_relay(server.url, headers).minus(before)


def bench_serve(args: argparse.Namespace) -> int:
    from kernels.model.loader import resolve_model_dir
    from kernels.model.tokenizer import load_tokenizer

    if args.dataset == "multiturn":
        from cluster.bench.multiturn import bench_multiturn

        return bench_multiturn(args)
    if args.num_requests < 1 or args.concurrency < 1:
        raise ValueError("--num-requests and --concurrency must be >= 1")
    if not 1 <= args.input_len[0] <= args.input_len[1] or not 1 <= args.output_len[0] <= args.output_len[1]:
        raise ValueError("--input-len and --output-len take MIN MAX with 1 <= MIN <= MAX")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    flags = serve_flags(args, tuple(QUEUE_ALL_SETS))
    config = load_config(flags)
    work = make_workload(args.num_requests, tuple(args.input_len), tuple(args.output_len),
                         len(load_tokenizer(resolve_model_dir(config.model))), args.seed)
    log.info("workload: %d requests, %d prompt tokens, %d output tokens, concurrency %d; offline engine on %d "
             "torch threads", len(work.prompts), sum(map(len, work.prompts)), work.num_output_tokens,
             args.concurrency, torch.get_num_threads())
    offline = None
    if not args.skip_baseline:  # before the server starts: the two would share the CPU
        offline = run_offline(dataclasses.replace(config.decode.engine, max_running_requests=args.concurrency), work)
        gc.collect()
    server = ExistingServer(args.url) if args.url else SpawnedServer(flags)
    try:
        served, timings, relay = measure_served(server, work, args.concurrency, args.ready_timeout_s)
    finally:
        exit_code = server.stop()
    summary = summarize(work, args.concurrency, served, offline, timings, relay, exit_code)
    print_summary(summary, args.json)
    return 0 if exit_code == 0 else 1


def summarize(work: Workload, concurrency: int, served: Throughput, offline: Throughput | None,
              timings: list[RequestTiming], relay: RelaySnapshot, exit_code: int) -> dict:
    def pct_s(values, q: float) -> float | None:
        return float(np.percentile(values, q)) if len(values) else None

    gaps_s = [g for t in timings for g in t.frame_gaps_s]
    results = [r for r in (served, offline) if r is not None]
    summary = {
        "workload": {"num_requests": len(work.prompts), "concurrency": concurrency,
                     "prompt_tokens": sum(map(len, work.prompts)), "output_tokens": work.num_output_tokens,
                     "offline_torch_threads": torch.get_num_threads()},
        "results": [{**dataclasses.asdict(r), "output_tokens_per_s": r.output_tokens_per_s,
                     "requests_per_s": len(work.prompts) / r.elapsed_s} for r in results],
        "latency_s": {f"{name}_p{q}": pct_s(values, q) for name, values in (
            ("ttft", [t.ttft_s for t in timings]), ("itl", gaps_s), ("e2e", [t.e2e_s for t in timings]))
            for q in (50, 99)},
        "relay": {"p50_s": bucket_quantile(0.5, relay.buckets), "p99_s": bucket_quantile(0.99, relay.buckets),
                  "num_messages": int(relay.num_messages), "num_tokens": int(relay.num_tokens),
                  "num_decode_polls": int(relay.num_polls),
                  "resolution": "histogram buckets"},
        "server_exit_code": exit_code,
    }
    if offline is not None:
        summary["ratio_served_over_offline"] = served.output_tokens_per_s / offline.output_tokens_per_s
    return summary


def _ms(value_s: float | None) -> str:
    return "n/a" if value_s is None else f"{value_s * 1e3:.1f}"


def print_summary(summary: dict, as_json: bool) -> None:
    print(f"{'system':<10}{'elapsed_s':>12}{'output_tokens':>15}{'tok/s':>10}{'req/s':>9}")
    for r in summary["results"]:
        print(f"{r['system']:<10}{r['elapsed_s']:>12.2f}{r['output_tokens']:>15}"
              f"{r['output_tokens_per_s']:>10.1f}{r['requests_per_s']:>9.2f}")
    if "ratio_served_over_offline" in summary:
        print(f"ratio served / offline: {summary['ratio_served_over_offline']:.2f}x")
    lat = summary["latency_s"]
    print(f"{'latency (client, ms)':<40}{'p50':>9}{'p99':>9}")
    for name, label in (("ttft", "TTFT"), ("itl", "ITL (gap between streamed text frames)"), ("e2e", "e2e")):
        print(f"  {label:<38}{_ms(lat[f'{name}_p50']):>9}{_ms(lat[f'{name}_p99']):>9}")
    relay = summary["relay"]
    print(f"  {'token relay worker -> gateway *':<38}{_ms(relay['p50_s']):>9}{_ms(relay['p99_s']):>9}")
    per_message = relay["num_tokens"] / relay["num_messages"] if relay["num_messages"] else float("nan")
    print(f"  * estimated from bucket counts of {RELAY} (bucket resolution)")
    per_poll = relay["num_messages"] / relay["num_decode_polls"] if relay["num_decode_polls"] else float("nan")
    print(f"relay: {relay['num_messages']} token messages for {relay['num_tokens']} tokens "
          f"({per_message:.2f} tokens per message), carried by {relay['num_decode_polls']} decode-worker calls "
          f"({per_poll:.1f} messages per call)")
    if as_json:
        print(json.dumps(summary))
