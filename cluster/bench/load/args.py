"""The flags of `tandem bench serve` (names and meanings as vLLM's `vllm bench serve` where both have one)."""

from __future__ import annotations

import argparse
import json

from cluster.bench.load.datasets import DATASETS

SWEEPABLE = ("request-rate", "max-concurrency")


def parse_sweep(text: str) -> tuple[str, tuple[float, ...]]:
    """"request-rate=1,2,4" -> ("request_rate", (1.0, 2.0, 4.0)); "max-concurrency=1,8" likewise (ints)."""
    name, sep, values = text.partition("=")
    if not sep or name not in SWEEPABLE:
        raise argparse.ArgumentTypeError(f"--sweep takes NAME=V1,V2,... with NAME one of {', '.join(SWEEPABLE)}; "
                                         f"got {text!r}")
    try:
        parsed = tuple((float if name == "request-rate" else int)(v) for v in values.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sweep {name}: expected comma-separated numbers, got {values!r}") from None
    return name.replace("-", "_"), parsed


def json_object(text: str) -> dict:
    """--extra-body's value: a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"--extra-body takes a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"--extra-body takes a JSON object, got {type(value).__name__}")
    return value


def add_load_args(p: argparse.ArgumentParser) -> None:
    p.description = ("Drive an OpenAI-compatible endpoint (--base-url: tandem or any other server; without it, a "
                     "`tandem serve` started here) with a dataset at a request rate and/or concurrency; prints "
                     "vLLM-style TTFT / TPOT / ITL / E2EL statistics, goodput and throughput.")
    target = p.add_argument_group("target")
    target.add_argument("--base-url", "--url", dest="url", metavar="URL",
                        help="server to load (http://host:port); default: start `tandem serve` here and stop it after")
    target.add_argument("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions")
    target.add_argument("--model", help="model name in the bodies (default: the first of the server's /v1/models)")
    target.add_argument("--api-key", help="bearer token (default: $OPENAI_API_KEY, else $TANDEM_API_KEY)")
    target.add_argument("--tokenizer", metavar="DIR", help="tokenizer for chat prompts and multi-turn histories "
                                                           "(default: the model of the tandem config)")
    target.add_argument("--temperature", type=float, default=0.0, help="sent in every body (default greedy)")
    target.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="ask for exact output lengths (servers that know ignore_eos)")
    target.add_argument("--extra-body", type=json_object, default={}, metavar="JSON",
                        help="fields merged into every body, e.g. '{\"response_format\": {...}}' (a grammar's cost)")
    target.add_argument("--http-client", choices=("auto", "aiohttp", "httpx"), default="auto",
                        help="the client's HTTP library (auto: aiohttp when installed, it costs less CPU per request)")
    target.add_argument("--config", metavar="FILE", help="cluster YAML of a server started here (and the baseline)")
    target.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="passed to `tandem serve`")
    target.add_argument("--ready-timeout-s", type=float, default=300.0, help="wait this long for the server")

    data = p.add_argument_group("dataset")
    data.add_argument("--dataset-name", choices=DATASETS, default="random")
    data.add_argument("--dataset-path", metavar="FILE", help="--dataset-name jsonl or mooncake-trace: the file")
    data.add_argument("--trace-block-size", type=int, default=512, help="mooncake-trace: tokens per hash id")
    data.add_argument("--trace-token-scale", type=float, default=1.0,
                      help="mooncake-trace: input/output lengths and the block size times this")
    data.add_argument("--trace-time-scale", type=float, default=1.0,
                      help="mooncake-trace: gaps between arrivals times this (2: half the request rate)")
    data.add_argument("--num-prompts", type=int, default=100, help="requests (multi-turn: conversations)")
    data.add_argument("--random-input-len", type=int, default=256, help="prompt tokens (shared-prefix: the suffix; "
                                                                          "multi-turn: new user tokens per turn)")
    data.add_argument("--random-output-len", type=int, default=64, help="output tokens asked for per request")
    data.add_argument("--random-range-ratio", type=float, default=0.0,
                      help="lengths drawn uniformly from [len * (1 - r), len * (1 + r)]")
    data.add_argument("--shared-prefix-len", type=int, default=512, help="shared-prefix: tokens of each prefix")
    data.add_argument("--shared-prefix-groups", type=int, default=4, help="shared-prefix: distinct prefixes")
    data.add_argument("--multi-turn-turns", type=int, default=4, help="multi-turn: turns per conversation")
    data.add_argument("--multi-turn-think-time-s", type=float, default=0.0, help="multi-turn: pause between turns")
    data.add_argument("--random-vocab-size", type=int, metavar="N",
                      help="draw random token ids below N (default: the tokenizer's vocabulary size)")
    data.add_argument("--seed", type=int, default=0, help="of the dataset and the arrival times")

    load = p.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=float("inf"),
                      help="requests/s, gamma arrivals (Poisson at --burstiness 1); inf: all at once")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: < 1 burstier, > 1 more even")
    load.add_argument("--max-concurrency", type=int, help="requests in flight at most (client side)")
    load.add_argument("--num-warmups", type=int, default=1, help="untimed requests before the run")
    load.add_argument("--sweep", type=parse_sweep, metavar="NAME=V1,V2,...",
                      help="one run per value of request-rate or max-concurrency: one table, one plot")
    load.add_argument("--num-clients", type=int, default=1, help="load clients; > 1: Ray actors spread over nodes")
    load.add_argument("--address", help="Ray cluster of the clients (default with --num-clients > 1: a local "
                                        "loopback Ray started here; 'auto' or host:port joins one)")
    load.add_argument("--client-cpus", type=float, default=1.0, help="CPUs each client actor reserves")

    out = p.add_argument_group("results")
    out.add_argument("--goodput", nargs="+", metavar="NAME:MS", help="SLOs of goodput: ttft:MS tpot:MS e2el:MS")
    out.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el", help="metrics to report statistics of")
    out.add_argument("--metric-percentiles", default="50,90,99", help="percentiles reported of each")
    out.add_argument("--save-result", action="store_true", help="write the result JSON (raw samples included)")
    out.add_argument("--result-filename", metavar="FILE", help="its name (default: from rate, concurrency, date)")
    out.add_argument("--plot-dir", metavar="DIR", help="write PNG plots here (needs matplotlib)")
    out.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    out.add_argument("--json", action="store_true", help="print the result (no raw samples) as JSON, last line")
    out.add_argument("--offline-baseline", action="store_true",
                     help="also run the same requests through the offline engine in this process first (tandem "
                          "config from --config / --set; token-id datasets) and report served / offline throughput")
