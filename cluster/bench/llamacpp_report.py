"""The figures of `tandem bench llamacpp`: per system, tandem / llama.cpp ratios against the
issue's targets, the table and the per-round spread."""

from __future__ import annotations

import dataclasses
import statistics
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from cluster.bench.llamacpp_runs import BenchSpec, SystemRun

ITL_TARGET = 1.1  # tandem's single-stream ITL p50 <= this x llama.cpp's
TTFT_TARGET = 1.3  # tandem's cold TTFT <= this x llama.cpp's
TOKS_TARGET = 1.2  # tandem's output tok/s at the concurrency run >= this x llama.cpp's
P99_ITL_TARGET = 0.5  # tandem's p99 inter-token gap at the concurrency run <= this x llama.cpp's
READY_TARGET_S = 15.0  # tandem serve: start to ready, seconds (after a first start has filled its caches)
SYSTEMS = ("llama.cpp", "tandem")


def system_figures(run: SystemRun) -> dict:
    gaps_s = [g for r in run.itl for g in r.frame_gaps_s]
    ttfts_s = [r.ttft_s for r in run.ttft]
    busy_gaps_s = [g for r in run.concurrent for g in r.frame_gaps_s]
    busy_ttfts_s = [r.ttft_s for r in run.concurrent]
    return {"itl_p50_s": _percentile(gaps_s, 50),
            "concurrent_itl_p50_s": _percentile(busy_gaps_s, 50), "concurrent_itl_p99_s": _percentile(busy_gaps_s, 99),
            "concurrent_ttft_p50_s": _percentile(busy_ttfts_s, 50),
            "ready_s": max(run.ready_s) if run.ready_s else None, "ready_all_s": list(run.ready_s),
            "itl_mean_s": statistics.fmean(gaps_s) if gaps_s else None,
            "itl_num_gaps": len(gaps_s), "itl_output_tokens": [r.output_tokens for r in run.itl],
            "ttft_best_s": min(ttfts_s), "ttft_median_s": statistics.median(ttfts_s), "ttft_all_s": ttfts_s,
            "concurrent_output_tokens": run.concurrent_output_tokens,
            "concurrent_elapsed_s": run.concurrent_elapsed_s,
            "concurrent_output_tokens_per_s": run.concurrent_output_tokens / run.concurrent_elapsed_s,
            "memory": None if run.memory is None else dataclasses.asdict(run.memory)}


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def ratio(tandem: float | None, llamacpp: float | None) -> float | None:
    return None if tandem is None or not llamacpp else tandem / llamacpp


def common_prefix_len(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def summarize(runs: dict[str, SystemRun], spec: BenchSpec, hf_text: str | None = None) -> dict:
    """Figures per system, tandem / llama.cpp ratios with the targets, and the greedy texts' agreement:
    with each other, and with `hf_text` (HF transformers' greedy text of the first stream's prompt, in
    the bench's dtype) where given."""
    figures = {name: system_figures(run) for name, run in runs.items()}
    ours, theirs = figures["tandem"], figures["llama.cpp"]

    def entry(key: str, target_max: float | None = None, target_min: float | None = None) -> dict:
        value = ratio(ours[key], theirs[key])
        met = None if value is None or (target_max is None and target_min is None) else \
            (target_max is None or value <= target_max) and (target_min is None or value >= target_min)
        return {"ratio": value, "target_max": target_max, "target_min": target_min, "met": met}

    ratios = {
        "itl_p50": entry("itl_p50_s", ITL_TARGET),
        "ttft_best": entry("ttft_best_s", TTFT_TARGET),
        "ttft_median": entry("ttft_median_s", TTFT_TARGET),
        "concurrent_output_tokens_per_s": entry("concurrent_output_tokens_per_s", target_min=TOKS_TARGET),
        "concurrent_itl_p50": entry("concurrent_itl_p50_s"),
        "concurrent_itl_p99": entry("concurrent_itl_p99_s", P99_ITL_TARGET),
        "concurrent_ttft_p50": entry("concurrent_ttft_p50_s"),
        "ready": entry("ready_s"),
        "rss": {"ratio": ratio(_rss(ours), _rss(theirs)), "target_max": None, "target_min": None, "met": None},
    }
    ready = ours["ready_s"]
    ratios["ready"]["tandem_target_max_s"] = READY_TARGET_S
    ratios["ready"]["tandem_met"] = None if ready is None else ready <= READY_TARGET_S
    text_ours, text_theirs = runs["tandem"].itl[0].text, runs["llama.cpp"].itl[0].text
    return {"spec": dataclasses.asdict(spec), "peer": runs["llama.cpp"].peer, "systems": figures,
            "ratios_tandem_over_llamacpp": ratios,
            "greedy_first_stream": {"common_prefix_chars": common_prefix_len(text_ours, text_theirs),
                                    "tandem_chars": len(text_ours), "llamacpp_chars": len(text_theirs),
                                    **({} if hf_text is None else {
                                        "hf_chars": len(hf_text),
                                        "tandem_hf_common_prefix_chars": common_prefix_len(text_ours, hf_text),
                                        "llamacpp_hf_common_prefix_chars": common_prefix_len(text_theirs, hf_text)})}}


def _rss(figures: dict) -> int | None:
    return None if figures["memory"] is None else figures["memory"]["rss_bytes"]


def _fmt(value: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value * scale:.{digits}f}"


def format_table(summary: dict) -> str:
    spec, sys_, rat = summary["spec"], summary["systems"], summary["ratios_tandem_over_llamacpp"]
    conc = spec["concurrency"]
    rows = [("single stream ITL p50 (ms)", "itl_p50_s", 1e3, "itl_p50"),
            (f"cold TTFT {spec['ttft_prompt_len']} tok, best (ms)", "ttft_best_s", 1e3, "ttft_best"),
            (f"cold TTFT {spec['ttft_prompt_len']} tok, median (ms)", "ttft_median_s", 1e3, "ttft_median"),
            (f"concurrency {conc} output tok/s", "concurrent_output_tokens_per_s", 1.0,
             "concurrent_output_tokens_per_s"),
            (f"concurrency {conc} ITL p50 (ms)", "concurrent_itl_p50_s", 1e3, "concurrent_itl_p50"),
            (f"concurrency {conc} ITL p99 (ms)", "concurrent_itl_p99_s", 1e3, "concurrent_itl_p99"),
            (f"concurrency {conc} TTFT p50 (ms)", "concurrent_ttft_p50_s", 1e3, "concurrent_ttft_p50"),
            ("start to ready, slowest round (s)", "ready_s", 1.0, "ready")]
    rss_mib = {name: None if (rss := _rss(sys_[name])) is None else rss / 2**20 for name in SYSTEMS}
    lines = [f"{'threads ' + str(spec['threads']):<36}{'llama.cpp':>11}{'tandem':>10}{'ratio':>9}{'target':>10}"]
    for label, key, scale, ratio_key in rows:
        lines.append(f"{label:<36}{_fmt(sys_['llama.cpp'][key], scale):>11}{_fmt(sys_['tandem'][key], scale):>10}"
                     f"{_fmt(rat[ratio_key]['ratio'], digits=2) + 'x':>9}  {_target_text(rat[ratio_key])}")
    lines.append(f"{'server RSS, all processes (MiB)':<36}{_fmt(rss_mib['llama.cpp'], digits=0):>11}"
                 f"{_fmt(rss_mib['tandem'], digits=0):>10}{_fmt(rat['rss']['ratio'], digits=2) + 'x':>9}")
    greedy = summary["greedy_first_stream"]
    lines.append(f"greedy text of the first stream: first {greedy['common_prefix_chars']} chars identical "
                 f"(tandem {greedy['tandem_chars']}, llama.cpp {greedy['llamacpp_chars']} chars)")
    if "hf_chars" in greedy:
        lines.append(f"  against HF transformers' greedy text ({spec['dtype']}, {greedy['hf_chars']} chars): tandem's "
                     f"first {greedy['tandem_hf_common_prefix_chars']} chars identical, llama.cpp's first "
                     f"{greedy['llamacpp_hf_common_prefix_chars']}")
    tokens = {name: sys_[name]["itl_output_tokens"] for name in SYSTEMS}
    lines.append(f"single-stream output tokens per run (asked {spec['output_len']}): {tokens}")
    lines.append(f"llama.cpp's server: {summary['peer']}")
    lines += [f"{name} memory after the runs: {_memory_text(sys_[name]['memory'])}" for name in SYSTEMS]
    return "\n".join(lines)


def _target_text(entry: dict) -> str:
    if "tandem_target_max_s" in entry:
        met = entry["tandem_met"]
        return f"tandem <={entry['tandem_target_max_s']:.0f}s " + ("n/a" if met is None else "ok" if met else "MISS")
    if entry["target_max"] is None and entry["target_min"] is None:
        return ""
    bound = f"<={entry['target_max']}x" if entry["target_max"] is not None else f">={entry['target_min']}x"
    return f"{bound} " + ("n/a" if entry["met"] is None else "ok" if entry["met"] else "MISS")


ROUND_KEYS = (("single stream ITL p50 (ms)", "itl_p50_s", 1e3), ("cold TTFT median (ms)", "ttft_median_s", 1e3),
              ("concurrency output tok/s", "concurrent_output_tokens_per_s", 1.0),
              ("concurrency ITL p99 (ms)", "concurrent_itl_p99_s", 1e3), ("start to ready (s)", "ready_s", 1.0))


def round_lines(per_round: dict[str, list[dict]]) -> list[str]:
    """Each key figure round by round (the spread behind the pooled figures above)."""
    lines = ["per round (llama.cpp | tandem):"]
    for label, key, scale in ROUND_KEYS:
        cells = [" ".join(_fmt(f[key], scale) for f in per_round[name]) for name in SYSTEMS]
        lines.append(f"  {label:<34}{cells[0]} | {cells[1]}")
    return lines


def _memory_text(memory: dict | None) -> str:
    if memory is None:
        return "n/a"
    pss = "n/a" if memory["pss_bytes"] is None else f"{memory['pss_bytes'] / 2**20:.0f}"
    return (f"RSS {memory['rss_bytes'] / 2**20:.0f} MiB, PSS {pss} MiB, summed over "
            f"{memory['num_processes']} processes")
