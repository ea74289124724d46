"""`tandem bench serve`: the command around the load harness.

    1. the dataset (datasets.py); random token ids are drawn below the tokenizer's vocabulary size
    2. --offline-baseline: the same requests through the offline engine here, before any server runs
    3. the server: --base-url (not started or stopped here; ready when /v1/models answers), or a
       `tandem serve` started here (ready on /health/ready) and stopped with SIGTERM at the end
    4. one run, or one per --sweep value (dataset seed + i, so a prefix cache cannot serve run i's
       prompts from run i - 1), by one in-process client or N Ray actor clients
    5. per run: the summary block, the result dict (metrics.py), plots; for a sweep one table and one plot

A tandem server's token relay histogram (`tandem:token_relay_seconds` on /metrics) is diffed across
each run and reported; other servers simply have none.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import logging
import math
import os
import sys
from pathlib import Path

from cluster.bench.load.client import ClientRun, LoadShape, Target, run_client, warm_up
from cluster.bench.load.datasets import DatasetSpec, SampleRequest, TokenizerCodec, make_jobs, num_requests
from cluster.bench.load.metrics import (
    compute_result,
    format_summary,
    parse_goodput,
    parse_metric_names,
    parse_percentiles,
    per_turn,
    percentile_key,
    samples_s,
)
from cluster.bench.load.multinode import ClientPlan, RayClients, merge_runs, split_plans
from cluster.bench.load.phases import fetch_timelines, format_phases, ttft_phases
from cluster.bench.load.plots import MISSING_HINT, matplotlib_available, plot_run, plot_sweep

log = logging.getLogger("tandem.bench")

RAW_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times", "queue_times", "errors",
            "request_ids", "time_series")


@dataclasses.dataclass(frozen=True)
class Reporting:
    metric_names: tuple[str, ...]
    percentiles: tuple[float, ...]
    slos_ms: dict


class InProcessClient:
    """One client on this process's event loop (the `RayClients` interface, without Ray)."""

    nodes = ("this process",)

    def __init__(self, codec, show_progress: bool):
        self.codec, self.show_progress = codec, show_progress

    def __enter__(self) -> InProcessClient:
        return self

    def __exit__(self, *exc_info) -> None:
        pass

    def run(self, target: Target, plans: list[ClientPlan]) -> list[ClientRun]:
        (plan,) = plans
        return [asyncio.run(run_client(target, list(plan.jobs), plan.shape, self.codec, self.show_progress))]


# ---- the pieces ----------------------------------------------------------------------------------
def api_key(args: argparse.Namespace) -> str | None:
    return args.api_key or os.environ.get("OPENAI_API_KEY") or os.environ.get("TANDEM_API_KEY")


def first_model(url: str, headers: dict) -> str | None:
    """The first model id the server lists on /v1/models; None when it lists none or has no such route."""
    import httpx

    try:
        return httpx.get(f"{url}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return None


def tandem_model_dir(args: argparse.Namespace) -> str:
    from cluster.bench.serve import QUEUE_ALL_SETS, load_config, serve_flags
    from kernels.model.loader import resolve_model_dir

    return str(resolve_model_dir(load_config(serve_flags(args, tuple(QUEUE_ALL_SETS))).model))


def needs_tokenizer(args: argparse.Namespace) -> bool:
    chat = args.endpoint.rstrip("/").endswith("chat/completions")
    return bool(args.tokenizer) or args.dataset_name == "multi-turn" or (chat and args.dataset_name != "jsonl") or (
        args.random_vocab_size is None and args.dataset_name != "jsonl")


def dataset_spec(args: argparse.Namespace, vocab_size: int | None) -> DatasetSpec:
    return DatasetSpec(args.dataset_name, args.num_prompts, args.random_input_len, args.random_output_len,
                       args.random_range_ratio, args.shared_prefix_len, args.shared_prefix_groups,
                       args.multi_turn_turns,
                       args.multi_turn_think_time_s, args.dataset_path, vocab_size or DatasetSpec.vocab_size,
                       args.trace_block_size, args.trace_token_scale, args.trace_time_scale)


def offline_baseline(args: argparse.Namespace, jobs: list, max_concurrency: int | None) -> dict:
    """The same requests through `EngineCore.generate` here, at most `max_concurrency` running."""
    from cluster.bench.offline import Workload
    from cluster.bench.serve import QUEUE_ALL_SETS, load_config, run_offline, serve_flags

    if not all(isinstance(j, SampleRequest) and isinstance(j.prompt, tuple)
               and all(isinstance(t, int) for t in j.prompt)
               for j in jobs):
        raise ValueError("--offline-baseline needs token-id prompts: --dataset-name random or shared-prefix")
    config = load_config(serve_flags(args, tuple(QUEUE_ALL_SETS)))
    engine_config = dataclasses.replace(config.decode.engine, max_running_requests=max_concurrency or len(jobs))
    offline = run_offline(engine_config, Workload([list(j.prompt) for j in jobs], [j.output_len for j in jobs]))
    return {"elapsed_s": offline.elapsed_s, "output_tokens": offline.output_tokens,
            "output_throughput": offline.output_tokens_per_s,
            "max_running_requests": engine_config.max_running_requests}


def try_relay(url: str, headers: dict):
    """The server's relay histogram snapshot, or None (not tandem, or no /metrics)."""
    from cluster.bench.serve import scrape_relay

    try:
        snapshot = scrape_relay(url, headers)
    except Exception:  # noqa: BLE001 - any server without tandem's /metrics
        return None
    return snapshot if snapshot.buckets else None


def relay_block(before, after) -> dict | None:
    from cluster.bench.serve import bucket_quantile

    if before is None or after is None:
        return None
    diff = after.minus(before)
    return {"p50_s": bucket_quantile(0.5, diff.buckets), "p99_s": bucket_quantile(0.99, diff.buckets),
            "num_messages": int(diff.num_messages), "num_tokens": int(diff.num_tokens),
            "num_decode_polls": int(diff.num_polls), "resolution": "histogram buckets"}


# ---- one run -------------------------------------------------------------------------------------
def run_point(clients, target: Target, jobs: list, shape: LoadShape, num_clients: int, reporting: Reporting,
              headers: dict, num_warmups: int, codec) -> tuple[dict, list]:
    """One measured run, after its warm-up requests: (its result dict, its merged raw samples)."""
    asyncio.run(warm_up(target, jobs, num_warmups, codec))
    before = try_relay(target.base_url, headers)
    runs = clients.run(target, split_plans(jobs, shape, num_clients))
    outputs, duration_s, _ = merge_runs(runs)
    relay = relay_block(before, try_relay(target.base_url, headers))
    split = ttft_phases(outputs, fetch_timelines(target.base_url, headers, len(outputs)))
    result = {
        "date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if target.is_chat else "openai", "base_url": target.base_url,
        "endpoint": target.endpoint, "model_id": target.model, "num_prompts": len(jobs),
        "request_rate": "inf" if math.isinf(shape.request_rate) else shape.request_rate,
        "burstiness": shape.burstiness, "max_concurrency": shape.max_concurrency,
        "num_clients": num_clients, "client_nodes": list(clients.nodes),
        **compute_result(outputs, duration_s, reporting.metric_names, reporting.percentiles, reporting.slos_ms),
    }
    if any(o.turn for o in outputs):
        result["turns"] = per_turn(outputs)
    if relay is not None:
        result["relay"] = relay
    if split is not None:
        result["ttft_phases"] = split
    result["connection_retries"] = sum(run.num_retries for run in runs)
    return result, outputs


def print_run(result: dict, reporting: Reporting) -> None:
    print(format_summary(result, reporting.metric_names, reporting.percentiles))
    for row in result.get("turns", ()):
        cached = "n/a" if row["mean_cached_tokens"] is None else f"{row['mean_cached_tokens']:.1f}"
        print(f"turn {row['turn']:>2}: {row['completed']} requests, mean input {row['mean_input_tokens']:.1f} tokens "
              f"(cached {cached}), TTFT mean {row['mean_ttft_ms']:.2f} ms, p99 {row['p99_ttft_ms']:.2f} ms")
    if result.get("ttft_phases"):
        print(format_phases(result["ttft_phases"]))
    relay = result.get("relay")
    if relay and relay["p50_s"] is not None:
        print(f"token relay worker -> gateway (bucket resolution): p50 {relay['p50_s'] * 1e3:.1f} ms, "
              f"p99 {relay['p99_s'] * 1e3:.1f} ms, {relay['num_tokens']} tokens in {relay['num_messages']} messages")
    if result.get("connection_retries"):
        print(f"{result['connection_retries']} requests met a pooled connection the server had closed and were sent "
              f"again on a fresh one (no response of theirs had begun)")
    errors = sorted({e for e in result["errors"] if e})
    if errors:
        print(f"{result['failed']} requests failed; first distinct errors:\n  "
              + "\n  ".join(e[:300] for e in errors[:3]), file=sys.stderr)


# ---- the command ---------------------------------------------------------------------------------
def bench_load(args: argparse.Namespace) -> int:
    from cluster.bench.serve import QUEUE_ALL_SETS, ExistingServer, SpawnedServer, serve_flags, wait_ready, wait_warm

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    reporting = Reporting(parse_metric_names(args.percentile_metrics), parse_percentiles(args.metric_percentiles),
                          parse_goodput(args.goodput))
    if args.num_clients < 1:
        raise ValueError("--num-clients must be >= 1")
    tokenizer_dir = (args.tokenizer or tandem_model_dir(args)) if needs_tokenizer(args) else None
    codec = TokenizerCodec(tokenizer_dir) if tokenizer_dir else None
    spec = dataset_spec(args, args.random_vocab_size or (codec.vocab_size if codec else None))
    make_jobs(spec, args.seed)  # a bad dataset fails before anything starts
    swept, values = args.sweep or (None, (None,))
    shapes = [_shape(args, swept, value) for value in values]
    baseline = None
    if args.offline_baseline:  # before the server starts: the two would share the CPU
        baseline = offline_baseline(args, make_jobs(spec, args.seed), shapes[0].max_concurrency)
    key = api_key(args)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    server = ExistingServer(args.url) if args.url else SpawnedServer(serve_flags(args, tuple(QUEUE_ALL_SETS)))
    results = []
    try:
        if args.url:
            wait_ready(server, headers, args.ready_timeout_s, path="/v1/models", name="the server")
        else:
            wait_ready(server, headers, args.ready_timeout_s)
        wait_warm(server, headers, args.ready_timeout_s)
        target = Target(server.url, args.endpoint, args.model or first_model(server.url, headers), key,
                        args.ignore_eos, args.temperature, args.extra_body, http_library=args.http_client)
        use_ray = args.num_clients > 1 or args.address is not None
        clients = (RayClients(args.address or "local", args.num_clients, tokenizer_dir, args.client_cpus) if use_ray
                   else InProcessClient(codec, not args.disable_tqdm))
        with clients:
            for i, shape in enumerate(shapes):
                jobs = make_jobs(spec, args.seed + i)
                log.info("run %d/%d: %d requests, rate %s, burstiness %s, max concurrency %s, %d client(s)", i + 1,
                         len(shapes), num_requests(jobs), shape.request_rate, shape.burstiness, shape.max_concurrency,
                         args.num_clients)
                result, outputs = run_point(clients, target, jobs, shape, args.num_clients, reporting, headers,
                                            args.num_warmups, codec)
                if baseline is not None and i == 0:
                    result["offline_baseline"] = baseline
                    result["output_throughput_ratio_served_over_offline"] = (
                        result["output_throughput"] / baseline["output_throughput"])
                print_run(result, reporting)
                results.append((result, outputs))
    finally:
        exit_code = server.stop()
    _report(args, swept, values, results, reporting)
    ok = exit_code == 0 and all(r["completed"] for r, _ in results)
    return 0 if ok else 1


def _shape(args: argparse.Namespace, swept: str | None, value) -> LoadShape:
    fields = {"request_rate": args.request_rate, "max_concurrency": args.max_concurrency}
    if swept is not None:
        fields[swept] = value
    return LoadShape(fields["request_rate"], args.burstiness, fields["max_concurrency"], args.seed)


def _report(args: argparse.Namespace, swept: str | None, values, results: list, reporting: Reporting) -> None:
    """The sweep table, the result file, the plots, the --json line."""
    if swept is not None:
        print(format_sweep_table(swept, values, [r for r, _ in results], reporting))
    stem = Path(args.result_filename).stem if args.result_filename else _default_stem(args, swept)
    if args.save_result:
        path = Path(args.result_filename or f"{stem}.json")
        payload = results[0][0] if swept is None else {"sweep": swept, "values": list(values),
                                                       "runs": [r for r, _ in results]}
        path.write_text(json.dumps(payload))
        print(f"result saved to {path}")
    if args.plot_dir:
        _plot(Path(args.plot_dir), stem, swept, values, results)
    if args.json:
        slim = [{k: v for k, v in r.items() if k not in RAW_KEYS} for r, _ in results]
        print(json.dumps(slim[0] if swept is None else {"sweep": swept, "values": list(values), "runs": slim}))


def _default_stem(args: argparse.Namespace, swept: str | None) -> str:
    now = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    if swept is not None:
        return f"tandem-bench-sweep-{swept.replace('_', '-')}-{now}"
    concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
    return f"tandem-bench-{args.request_rate}qps{concurrency}-{now}"


def _plot(plot_dir: Path, stem: str, swept: str | None, values, results: list) -> None:
    if not matplotlib_available():
        print(MISSING_HINT, file=sys.stderr)
        return
    plot_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for value, (result, outputs) in zip(values, results):
        suffix = "" if swept is None else f"-{swept.replace('_', '-')}{value}"
        written += plot_run(samples_s(outputs), result["time_series"], plot_dir / f"{stem}{suffix}")
    if swept is not None:
        rows = [{swept: value, **result} for value, (result, _) in zip(values, results)]
        written.append(plot_sweep(rows, swept, plot_dir / stem))
    print("plots: " + ", ".join(str(p) for p in written))


def format_sweep_table(swept: str, values, results: list[dict], reporting: Reporting) -> str:
    """One row per run: throughput, goodput and the latency statistics reported."""
    pk = f"p{percentile_key(reporting.percentiles[-1])}"
    columns = [("completed", "done", "{:d}"), ("failed", "failed", "{:d}"), ("request_throughput", "req/s", "{:.2f}"),
               ("request_goodput", "good/s", "{:.2f}"), ("output_throughput", "out tok/s", "{:.1f}")]
    for name in reporting.metric_names:
        columns += [(f"median_{name}_ms", f"{name} p50", "{:.1f}"), (f"{pk}_{name}_ms", f"{name} {pk}", "{:.1f}")]
    header = f"{swept:>16}" + "".join(f"{label:>12}" for _, label, _ in columns)
    lines = [header]
    for value, result in zip(values, results):
        cells = ["n/a" if result.get(key) is None else fmt.format(result[key]) for key, _, fmt in columns]
        lines.append(f"{value!s:>16}" + "".join(f"{c:>12}" for c in cells))
    return "\n".join(lines)
