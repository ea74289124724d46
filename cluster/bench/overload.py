"""`tandem bench overload`: does `tandem serve` fail fast under overload, and keep its promises to
the requests it takes?

    1. unloaded   `--unloaded-requests` requests one at a time: the unloaded TTFT
    2. capacity   `--capacity-clients` closed-loop clients for `--capacity-s` seconds (a 429 makes a
                  client pause `REFUSED_PAUSE_S`): completed requests per second is the sustainable rate
                  (or `--capacity-rps` given: no measurement), output tokens per second the peak
    3. overload   open-loop Poisson arrivals at `--factor` x that rate for `--duration-s` seconds

The promise checked for the overload phase, per request: an admitted request's first token within
the TTFT budget (the server's `router.max_queue_delay_s`, or `--ttft-budget-s`) + `--answer-within-s`,
a refused one's 429 within `--answer-within-s` of arrival, no other outcome; and the output tokens
per second served during overload (from a quarter into the run to its last arrival, each admitted
request's tokens spread evenly between its first token and its end) at least `PEAK_SHARE` of the
capacity run's. Times count from each request's scheduled arrival, so a client that falls behind its
schedule is charged to the server's figures, never hidden; the largest such lag is reported.

Every request is a streaming /v1/completions call with a random-token prompt and an exact output
length (EOS ignored), as in `tandem bench serve`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import random
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from cluster.bench.offline import Workload, make_workload
from cluster.bench.serve import ExistingServer, SpawnedServer, load_config, serve_flags, wait_ready, wait_warm

log = logging.getLogger("tandem.bench")

REFUSED_PAUSE_S = 0.25  # a closed-loop client's pause after a 429 (shorter than Retry-After: keep it saturated)
DRAIN_TIMEOUT_S = 120.0  # requests still open this long after the last arrival count as unanswered
PEAK_SHARE = 0.9  # of the capacity run's output tok/s that the server must keep serving under overload


@dataclass(frozen=True)
class Outcome:
    """One request, times in seconds since its scheduled arrival."""

    status: int  # HTTP status; 0 when no response came (connection error)
    answer_s: float  # the first token (200) or the response itself (429, errors)
    end_s: float  # the stream's end (200) or the response (otherwise)
    lag_s: float  # how late the client sent it (its own scheduling delay)
    num_tokens: int = 0  # output tokens asked for (what an admitted request streamed)
    retry_after_s: float | None = None  # 429 / 503: the Retry-After header
    error: str = ""  # a 200 that failed mid-stream or came short; or the body of another status
    at_s: float = 0.0  # its scheduled arrival, seconds into the open-loop run

    @property
    def admitted(self) -> bool:
        return self.status == 200 and not self.error

    @property
    def refused(self) -> bool:
        return self.status == 429


# ---- one request -----------------------------------------------------------------------------------
async def send_one(client, prompt: list[int], output_len: int, headers: dict, arrival_s: float) -> Outcome:
    """Stream one completion; `arrival_s` is its scheduled arrival (perf_counter)."""
    import httpx

    body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    lag_s = max(0.0, time.perf_counter() - arrival_s)
    try:
        async with client.stream("POST", "/v1/completions", json=body, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread())[:300].decode(errors="replace")
                now_s = time.perf_counter() - arrival_s
                return Outcome(resp.status_code, now_s, now_s, lag_s, retry_after_s=_retry_after(resp), error=text)
            first_s, error = await _read_stream(resp, output_len, arrival_s)
    except httpx.HTTPError as exc:
        now_s = time.perf_counter() - arrival_s
        return Outcome(0, now_s, now_s, lag_s, error=f"{type(exc).__name__}: {exc}")
    end_s = time.perf_counter() - arrival_s
    return Outcome(200, end_s if first_s is None else first_s, end_s, lag_s, num_tokens=output_len, error=error)


async def _read_stream(resp, output_len: int, arrival_s: float) -> tuple[float | None, str]:
    """(seconds from arrival to the first text frame, "" or what went wrong)."""
    first_s, completion_tokens = None, None
    async for line in resp.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        frame = json.loads(line[len("data: "):])
        if "error" in frame:
            return first_s, f"failed mid-stream: {frame['error']}"
        if frame.get("usage"):
            completion_tokens = frame["usage"]["completion_tokens"]
        if first_s is None and any(choice.get("text") for choice in frame.get("choices", ())):
            first_s = time.perf_counter() - arrival_s
    if completion_tokens != output_len:
        return first_s, f"asked for {output_len} tokens, got {completion_tokens}"
    return first_s, ""


def _retry_after(resp) -> float | None:
    value = resp.headers.get("retry-after")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _client(url: str, concurrency: int):
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    return httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(DRAIN_TIMEOUT_S), limits=limits)


# ---- the three phases ------------------------------------------------------------------------------
async def run_unloaded(url: str, work: Workload, headers: dict) -> list[Outcome]:
    async with _client(url, 1) as client:
        return [await send_one(client, prompt, n, headers, time.perf_counter())
                for prompt, n in zip(work.prompts, work.output_lens)]


async def run_capacity(url: str, work: Workload, headers: dict, clients: int,
                       duration_s: float) -> tuple[float, float]:
    """(completed requests per second, output tokens per second) with `clients` closed-loop clients
    (a 429 costs a pause)."""
    stop_s = time.perf_counter() + duration_s
    turn = iter(range(1 << 62))  # shared by the clients; one loop thread, so no lock
    completions_s: list[tuple[float, int]] = []

    async def client_loop(client) -> None:
        while time.perf_counter() < stop_s:
            i = next(turn) % len(work.prompts)
            outcome = await send_one(client, work.prompts[i], work.output_lens[i], headers, time.perf_counter())
            if outcome.admitted:
                completions_s.append((time.perf_counter(), outcome.num_tokens))
            elif outcome.refused:
                await asyncio.sleep(REFUSED_PAUSE_S)
            else:
                raise RuntimeError(f"capacity run: a request failed ({outcome.status}): {outcome.error}")

    async with _client(url, clients) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
    done = [n for t, n in completions_s if t <= stop_s]
    return len(done) / duration_s, sum(done) / duration_s


def served_tokens_per_s(outcomes: list, start_s: float, stop_s: float) -> float:
    """Output tokens per second the admitted requests streamed within [start_s, stop_s] (seconds into
    the open-loop run): each request's first token at its first-token time, the rest spread evenly
    to its end."""
    total = 0.0
    for o in outcomes:
        if not o.admitted or o.num_tokens < 1:
            continue
        first, end = o.at_s + o.answer_s, o.at_s + o.end_s
        total += start_s <= first <= stop_s
        rest = o.num_tokens - 1
        if rest and end > first:
            overlap = max(0.0, min(end, stop_s) - max(first, start_s))
            total += rest * overlap / (end - first)
        elif rest and start_s <= end <= stop_s:
            total += rest
    return total / (stop_s - start_s)


def poisson_arrivals(rate_rps: float, duration_s: float, seed: int) -> list[float]:
    """Arrival times in [0, duration_s) of a Poisson process of `rate_rps`."""
    rng = random.Random(seed)
    arrivals_s, t = [], rng.expovariate(rate_rps)
    while t < duration_s:
        arrivals_s.append(t)
        t += rng.expovariate(rate_rps)
    return arrivals_s


async def run_open_loop(url: str, work: Workload, headers: dict, arrivals_s: list[float]) -> list[Outcome]:
    """Each request sent at its arrival time whatever the others are doing; waits for them all."""
    async with _client(url, max(16, len(arrivals_s))) as client:
        start_s = time.perf_counter()
        tasks = []
        for i, at_s in enumerate(arrivals_s):
            await asyncio.sleep(max(0.0, start_s + at_s - time.perf_counter()))
            j = i % len(work.prompts)
            tasks.append(asyncio.create_task(
                send_one(client, work.prompts[j], work.output_lens[j], headers, start_s + at_s)))
        outcomes = await asyncio.gather(*tasks)
    return [dataclasses.replace(o, at_s=at_s) for o, at_s in zip(outcomes, arrivals_s)]


def scrape_admission(url: str, headers: dict) -> dict:
    """What the router's admission measured per worker (GET /debug/workers)."""
    import httpx

    workers = httpx.get(f"{url}/debug/workers", headers=headers, timeout=30).json()["workers"]
    return {w["worker_id"]: w.get("admission") for w in workers}


# ---- the whole run ---------------------------------------------------------------------------------
def bench_overload(args: argparse.Namespace) -> int:
    from kernels.model.loader import resolve_model_dir
    from kernels.model.tokenizer import load_tokenizer

    _check_args(args)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    flags = serve_flags(args)
    config = load_config(flags)
    vocab_size = len(load_tokenizer(resolve_model_dir(config.model)))
    work = make_workload(256, tuple(args.input_len), tuple(args.output_len), vocab_size, args.seed)
    unloaded_work = make_workload(args.unloaded_requests, tuple(args.input_len), tuple(args.output_len), vocab_size,
                                  args.seed + 1)
    key = os.environ.get("TANDEM_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    server = ExistingServer(args.url) if args.url else SpawnedServer(flags)
    try:
        wait_ready(server, headers, args.ready_timeout_s)
        wait_warm(server, headers, args.ready_timeout_s)
        asyncio.run(run_unloaded(server.url, Workload([work.prompts[0][:16]], [4]), headers))  # first-call costs
        unloaded = asyncio.run(run_unloaded(server.url, unloaded_work, headers))
        capacity_rps, peak_tok_s = args.capacity_rps, None
        if capacity_rps is None:
            capacity_rps, peak_tok_s = asyncio.run(
                run_capacity(server.url, work, headers, args.capacity_clients, args.capacity_s))
        if capacity_rps <= 0:
            raise RuntimeError("no request completed in the capacity run: lengthen --capacity-s")
        arrivals_s = poisson_arrivals(args.factor * capacity_rps, args.duration_s, args.seed)
        log.info("capacity %.2f req/s; overload: %d arrivals at %.2f req/s for %.0fs", capacity_rps,
                 len(arrivals_s), args.factor * capacity_rps, args.duration_s)
        loaded = asyncio.run(run_open_loop(server.url, work, headers, arrivals_s))
        admission = scrape_admission(server.url, headers)
    finally:
        exit_code = server.stop()
    budget_s = args.ttft_budget_s or config.router.max_queue_delay_s
    summary = summarize(args, unloaded, capacity_rps, peak_tok_s, budget_s, loaded, exit_code)
    summary["admission_after"] = admission
    print_summary(summary, args.json)
    return 0 if exit_code == 0 else 1


def _check_args(args: argparse.Namespace) -> None:
    if args.unloaded_requests < 1 or args.capacity_clients < 1:
        raise ValueError("--unloaded-requests and --capacity-clients must be >= 1")
    if min(args.capacity_s, args.duration_s, args.factor, args.answer_within_s) <= 0:
        raise ValueError("--capacity-s, --duration-s, --factor and --answer-within-s must be > 0")
    if args.ttft_budget_s is not None and args.ttft_budget_s <= 0:
        raise ValueError("--ttft-budget-s must be > 0")
    if args.capacity_rps is not None and args.capacity_rps <= 0:
        raise ValueError("--capacity-rps must be > 0")
    if not 1 <= args.input_len[0] <= args.input_len[1] or not 1 <= args.output_len[0] <= args.output_len[1]:
        raise ValueError("--input-len and --output-len take MIN MAX with 1 <= MIN <= MAX")


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(args: argparse.Namespace, unloaded: list[Outcome], capacity_rps: float, peak_tok_s: float | None,
              budget_s: float, loaded: list[Outcome], exit_code: int) -> dict:
    bad_unloaded = [o for o in unloaded if not o.admitted]
    if bad_unloaded:
        raise RuntimeError(f"{len(bad_unloaded)} unloaded requests failed, e.g. {bad_unloaded[0]}")
    unloaded_ttft = [o.answer_s for o in unloaded]
    admitted = [o for o in loaded if o.admitted]
    ttft = [o.answer_s for o in admitted]
    within_s = args.answer_within_s
    in_time = [o for o in loaded if (o.admitted and o.answer_s <= budget_s + within_s)
               or (o.refused and o.answer_s <= within_s)]
    failed = [o for o in loaded if not (o.admitted or o.refused)]
    served_tok_s = served_tokens_per_s(loaded, args.duration_s / 4, args.duration_s)
    summary: dict[str, Any] = {
        "workload": {"input_len": list(args.input_len), "output_len": list(args.output_len), "factor": args.factor,
                     "duration_s": args.duration_s, "answer_within_s": within_s, "ttft_budget_s": budget_s},
        "unloaded": {"num_requests": len(unloaded), "ttft_p50_s": _pct(unloaded_ttft, 50),
                     "ttft_p99_s": _pct(unloaded_ttft, 99)},
        "capacity_rps": capacity_rps,
        "capacity_measured": args.capacity_rps is None,
        "peak_output_tok_s": peak_tok_s,
        "overload": {
            "arrival_rps": args.factor * capacity_rps, "num_requests": len(loaded), "num_admitted": len(admitted),
            "num_refused_429": sum(o.refused for o in loaded), "num_failed": len(failed),
            "failures": sorted({f"{o.status}: {o.error[:120]}" for o in failed})[:5],
            "kept_promise": len(in_time) / len(loaded) if loaded else None,
            "output_tok_s": served_tok_s,
            "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99), "ttft_max_s": max(ttft, default=None),
            "refusal_p99_s": _pct([o.answer_s for o in loaded if o.refused], 99),
            "refusal_max_s": max((o.answer_s for o in loaded if o.refused), default=None),
            "retry_after_s": sorted({o.retry_after_s for o in loaded if o.refused and o.retry_after_s is not None}),
            "e2e_p50_s": _pct([o.end_s for o in admitted], 50),
            "client_lag_max_s": max((o.lag_s for o in loaded), default=0.0),
            "slowest_admitted": [[round(o.at_s, 2), round(o.answer_s, 3)]  # [arrival s into the run, TTFT s]
                                 for o in sorted(admitted, key=lambda o: -o.answer_s)[:5]]},
        "server_exit_code": exit_code,
    }
    over = summary["overload"]
    summary["served_over_peak"] = served_tok_s / peak_tok_s if peak_tok_s else None
    summary["acceptance"] = {
        "every_request_first_token_within_budget_or_fast_429": over["kept_promise"] == 1.0,
        "no_other_failures": not failed,
        f"served_tok_s_at_least_{PEAK_SHARE:.0%}_of_peak": (summary["served_over_peak"] is not None
                                                              and summary["served_over_peak"] >= PEAK_SHARE)}
    return summary


def _ms(value_s: float | None) -> str:
    return "n/a" if value_s is None else f"{value_s * 1e3:.0f} ms"


def print_summary(summary: dict, as_json: bool) -> None:
    base, over, w = summary["unloaded"], summary["overload"], summary["workload"]
    how = "measured, closed loop" if summary["capacity_measured"] else "given"
    peak = summary["peak_output_tok_s"]
    print(f"unloaded ({base['num_requests']} requests, one at a time): TTFT p50 {_ms(base['ttft_p50_s'])}, "
          f"p99 {_ms(base['ttft_p99_s'])}")
    print(f"capacity: {summary['capacity_rps']:.2f} requests/s ({how}), "
          f"{'n/a' if peak is None else f'{peak:.1f}'} output tok/s")
    print(f"overload: {over['num_requests']} requests at {over['arrival_rps']:.2f}/s ({w['factor']:g}x) "
          f"for {w['duration_s']:g}s: {over['num_admitted']} admitted, {over['num_refused_429']} refused (429), "
          f"{over['num_failed']} failed {over['failures'] or ''}")
    share = over["kept_promise"]
    print(f"  first token within the {w['ttft_budget_s']:g}s budget + {w['answer_within_s']:g}s, or 429 within "
          f"{w['answer_within_s']:g}s: {'n/a' if share is None else f'{share:.1%}'} of requests "
          f"(client lag at most {_ms(over['client_lag_max_s'])})")
    print(f"  admitted TTFT p50 {_ms(over['ttft_p50_s'])}, p99 {_ms(over['ttft_p99_s'])}, "
          f"max {_ms(over['ttft_max_s'])}; 429 answered in p99 {_ms(over['refusal_p99_s'])}, "
          f"max {_ms(over['refusal_max_s'])}, Retry-After values {over['retry_after_s'][:8]}")
    print(f"  served {over['output_tok_s']:.1f} output tok/s during overload = "
          f"{_ratio(summary['served_over_peak'])} the capacity run's; admitted e2e p50 {_ms(over['e2e_p50_s'])}")
    for worker_id, measured in (summary.get("admission_after") or {}).items():
        print(f"router admission measured on {worker_id}: {measured}")
    print("acceptance: " + ", ".join(f"{name} {'PASS' if ok else 'FAIL'}"
                                     for name, ok in summary["acceptance"].items()))
    if as_json:
        print(json.dumps(summary))


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"
