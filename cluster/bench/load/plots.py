"""PNG plots of a run or a sweep, with matplotlib (the `bench` extra: `bash scripts/setup.sh bench`).

    <prefix>-latency-cdf.png   empirical CDFs of TTFT, TPOT, ITL and E2EL (ms)
    <prefix>-over-time.png     output tokens/s and requests in flight, per second of the run
    <prefix>-sweep.png         output throughput and median / p99 latencies against the swept value
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from cluster.bench.load.metrics import METRIC_TITLES, METRICS

MISSING_HINT = ("matplotlib is not installed in this environment, so no plots were written "
                "(it is in the `bench` extra: `bash scripts/setup.sh bench` enables --plot-dir)")


def matplotlib_available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def plot_run(samples_s: dict[str, list[float]], series: dict[str, list[float]], prefix: Path) -> list[Path]:
    """The latency CDFs and the over-time plot of one run; returns the files written."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, name in zip(axes.flat, METRICS):
        values_ms = np.sort(np.asarray(samples_s[name]) * 1e3)
        if len(values_ms):
            ax.step(values_ms, np.arange(1, len(values_ms) + 1) / len(values_ms), where="post")
        ax.set(title=METRIC_TITLES[name][1], xlabel="ms", ylabel="fraction <= x", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    fig.tight_layout()
    cdf_path = prefix.with_name(prefix.name + "-latency-cdf.png")
    fig.savefig(cdf_path, dpi=110)
    plt.close(fig)

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    top.plot(series["second"], series["output_tokens_per_s"])
    top.set(ylabel="output tokens / s")
    bottom.plot(series["second"], series["running_requests"], color="tab:orange")
    bottom.set(xlabel="second of the run", ylabel="requests in flight")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    time_path = prefix.with_name(prefix.name + "-over-time.png")
    fig.savefig(time_path, dpi=110)
    plt.close(fig)
    return [cdf_path, time_path]


def plot_sweep(rows: list[dict], swept: str, prefix: Path) -> Path:
    """Throughput and latency percentiles against the swept value (one point per run)."""
    plt = _pyplot()
    xs = [row[swept] for row in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    left.plot(xs, [row["output_throughput"] for row in rows], marker="o")
    left.set(xlabel=swept, ylabel="output tokens / s", title="throughput")
    for name in ("ttft", "tpot", "e2el"):
        for stat, style in (("median", "-"), ("p99", "--")):
            key = f"{stat}_{name}_ms"
            if key in rows[0]:
                right.plot(xs, [row[key] for row in rows], style, marker="o", label=f"{stat} {name}")
    right.set(xlabel=swept, ylabel="ms", title="latency", yscale="log")
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = prefix.with_name(prefix.name + "-sweep.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
