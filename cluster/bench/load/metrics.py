"""Raw per-request samples -> the result dict (vLLM `bench serve` key names) and its console summary.

Pure: no I/O besides `format_summary` returning text. Every statistic is computed from the raw
samples of all clients together (numpy's mean / median / population std / linear percentile), never
from per-client statistics.

    ttft   sent -> first content frame                       one sample per successful request
    tpot   (latency - ttft) / (output_tokens - 1)            requests with more than one output token
    itl    gaps between consecutive content frames           every gap of every request
    e2el   sent -> last content frame                        one sample per successful request

Goodput counts the successful requests meeting every SLO given (`ttft:MS tpot:MS e2el:MS`,
value <= SLO); a request with one output token has tpot 0 for it (vLLM's rule).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from cluster.bench.load.client import RequestOutput

METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_TITLES = {"ttft": ("TTFT", "Time to First Token"), "tpot": ("TPOT", "Time per Output Token (excl. 1st)"),
                 "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency")}
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    """["ttft:200", "tpot:50"] -> {"ttft": 200.0, "tpot": 50.0} (milliseconds)."""
    slos = {}
    for pair in pairs or ():
        name, sep, value = pair.partition(":")
        try:
            slos[name] = float(value) if sep else float("nan")
        except ValueError:
            slos[name] = float("nan")
        if name not in GOODPUT_METRICS or not slos[name] >= 0:
            raise ValueError(f"--goodput takes NAME:MS pairs, NAME one of {', '.join(GOODPUT_METRICS)} and "
                             f"MS >= 0; got {pair!r}")
    return slos


def parse_metric_names(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in METRICS]
    if unknown or not names:
        raise ValueError(f"--percentile-metrics takes a comma-separated subset of {','.join(METRICS)}, got {text!r}")
    return names


def parse_percentiles(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(p) for p in text.split(","))
    except ValueError:
        values = ()
    if not values or not all(0 <= p <= 100 for p in values):
        raise ValueError(f"--metric-percentiles takes comma-separated numbers in [0, 100], got {text!r}")
    return values


def tpot_s(output: RequestOutput) -> float | None:
    """None for a request with fewer than two output tokens (no decode phase)."""
    if output.output_tokens <= 1:
        return None
    return (output.latency_s - output.ttft_s) / (output.output_tokens - 1)


def samples_s(outputs: list[RequestOutput]) -> dict[str, list[float]]:
    """The raw samples of each metric (seconds), from the successful requests."""
    ok = [o for o in outputs if o.success]
    return {"ttft": [o.ttft_s for o in ok], "tpot": [t for t in map(tpot_s, ok) if t is not None],
            "itl": [g for o in ok for g in o.itl_s], "e2el": [o.latency_s for o in ok]}


def is_good(output: RequestOutput, slos_ms: dict[str, float]) -> bool:
    if not output.success:
        return False
    values_s = {"ttft": output.ttft_s, "tpot": tpot_s(output) or 0.0, "e2el": output.latency_s}
    return all(values_s[name] * 1e3 <= slo for name, slo in slos_ms.items())


def percentile_key(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def metric_stats_ms(values_s: list[float], percentiles: tuple[float, ...]) -> dict:
    """mean / median / std / pXX in ms of raw samples; 0.0 for no samples (as vLLM reports)."""
    values_ms = np.asarray(values_s, dtype=np.float64) * 1e3 if values_s else np.zeros(1)
    stats = {"mean": float(np.mean(values_ms)), "median": float(np.median(values_ms)),
             "std": float(np.std(values_ms))}
    stats.update({f"p{percentile_key(p)}": float(np.percentile(values_ms, p)) for p in percentiles})
    return stats


def time_series(outputs: list[RequestOutput], duration_s: float) -> dict[str, list[float]]:
    """Per one-second bucket of the run: content frames (~ output tokens) that arrived and requests
    in flight at any time within it."""
    num_buckets = max(1, math.ceil(duration_s))
    tokens = np.zeros(num_buckets)
    running = np.zeros(num_buckets)
    for o in outputs:
        if not o.success:
            continue
        frame_times = o.start_s + o.ttft_s + np.concatenate(([0.0], np.cumsum(o.itl_s)))
        np.add.at(tokens, np.clip(frame_times.astype(int), 0, num_buckets - 1), 1)
        first, last = int(o.start_s), min(num_buckets - 1, int(o.start_s + o.latency_s))
        running[first:last + 1] += 1
    return {"second": list(range(num_buckets)), "output_tokens_per_s": tokens.tolist(),
            "running_requests": running.tolist()}


def peak_concurrency(outputs: list[RequestOutput]) -> int:
    """Most requests in flight at one instant ([start, end) intervals; an end before a start at a tie)."""
    events = sorted((t, d) for o in outputs if o.success for t, d in ((o.start_s, 1), (o.start_s + o.latency_s, -1)))
    level = peak = 0
    for _, delta in events:
        level += delta
        peak = max(peak, level)
    return peak


def compute_result(outputs: list[RequestOutput], duration_s: float, metric_names: tuple[str, ...] = METRICS,
                   percentiles: tuple[float, ...] = (50, 90, 99), slos_ms: dict[str, float] | None = None) -> dict:
    """The result dict: vLLM's aggregate keys, the selected metrics' statistics, and the raw samples."""
    ok = [o for o in outputs if o.success]
    total_input = sum(o.prompt_len for o in ok)
    total_output = sum(o.output_tokens for o in ok)
    series = time_series(outputs, duration_s)
    result: dict[str, Any] = {  # JSON: figures, then the raw samples
        "duration": duration_s, "completed": len(ok), "failed": len(outputs) - len(ok),
        "total_input_tokens": total_input, "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration_s,
        "request_goodput": sum(is_good(o, slos_ms) for o in ok) / duration_s if slos_ms else None,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "max_output_tokens_per_s": max(series["output_tokens_per_s"]),
        "max_concurrent_requests": peak_concurrency(outputs),
    }
    raw = samples_s(outputs)
    for name in metric_names:
        for stat, value in metric_stats_ms(raw[name], percentiles).items():
            result[f"{stat}_{name}_ms"] = value
    result.update({
        "input_lens": [o.prompt_len for o in outputs], "output_lens": [o.output_tokens for o in outputs],
        "ttfts": [o.ttft_s for o in outputs], "itls": [list(o.itl_s) for o in outputs],
        "latencies": [o.latency_s for o in outputs], "start_times": [o.start_s for o in outputs],
        "queue_times": [o.queue_s for o in outputs], "errors": [o.error for o in outputs],
        "request_ids": [[o.index, o.turn] for o in outputs], "time_series": series,
    })
    return result


def per_turn(outputs: list[RequestOutput]) -> list[dict]:
    """Multi-turn runs: TTFT and the prefix-cache hits per turn index (successful requests)."""
    rows = []
    for turn in sorted({o.turn for o in outputs if o.turn}):
        ok = [o for o in outputs if o.turn == turn and o.success]
        ttfts_ms = [o.ttft_s * 1e3 for o in ok] or [0.0]
        cached = [o.cached_tokens for o in ok if o.cached_tokens is not None]
        rows.append({"turn": turn, "completed": len(ok), "mean_ttft_ms": float(np.mean(ttfts_ms)),
                     "p99_ttft_ms": float(np.percentile(ttfts_ms, 99)),
                     "mean_input_tokens": float(np.mean([o.prompt_len for o in ok])) if ok else 0.0,
                     "mean_cached_tokens": float(np.mean(cached)) if cached else None})
    return rows


# ---- the console summary -------------------------------------------------------------------------
def _line(label: str, value) -> str:
    text = f"{value:.2f}" if isinstance(value, float) else str(value)
    return f"{label:<40} {text:<10}"


def format_summary(result: dict, metric_names: tuple[str, ...], percentiles: tuple[float, ...]) -> str:
    """The result as a fixed-width block (the layout vLLM prints, so tools that read one read both)."""
    lines = [f"{' Serving Benchmark Result ':=^50}", _line("Successful requests:", result["completed"]),
             _line("Failed requests:", result["failed"])]
    if result.get("max_concurrency") is not None:
        lines.append(_line("Maximum request concurrency:", result["max_concurrency"]))
    if result.get("request_rate") not in (None, "inf"):
        lines.append(_line("Request rate configured (RPS):", float(result["request_rate"])))
    lines += [_line("Benchmark duration (s):", result["duration"]),
              _line("Total input tokens:", result["total_input_tokens"]),
              _line("Total generated tokens:", result["total_output_tokens"]),
              _line("Request throughput (req/s):", result["request_throughput"])]
    if result["request_goodput"] is not None:
        lines.append(_line("Request goodput (req/s):", result["request_goodput"]))
    lines += [_line("Output token throughput (tok/s):", result["output_throughput"]),
              _line("Peak output token throughput (tok/s):", float(result["max_output_tokens_per_s"])),
              _line("Peak concurrent requests:", float(result["max_concurrent_requests"])),
              _line("Total token throughput (tok/s):", result["total_token_throughput"])]
    for name in metric_names:
        short, title = METRIC_TITLES[name]
        lines.append(f"{title:-^50}")
        lines.append(_line(f"Mean {short} (ms):", result[f"mean_{name}_ms"]))
        lines.append(_line(f"Median {short} (ms):", result[f"median_{name}_ms"]))
        lines += [_line(f"P{percentile_key(p)} {short} (ms):", result[f"p{percentile_key(p)}_{name}_ms"])
                  for p in percentiles]
    lines.append("=" * 50)
    return "\n".join(lines)
