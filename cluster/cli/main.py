"""The `tandem` command line. Subcommands import their machinery lazily (top of the import graph).

    tandem serve  the cluster: Ray workers, router and the OpenAI-compatible gateway
    tandem run    offline generation in one process (colocated engine)
    tandem bench  benchmarks that measure tandem and a baseline in the same run, and its overload behaviour
"""

from __future__ import annotations

import argparse
import logging
import sys

from cluster.bench.load.args import add_load_args
from common.engine_flags import add_engine_args

log = logging.getLogger("tandem")


def _add_run_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file", help="JSONL: each line a string, or an object with 'prompt' or 'messages'")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt per line on stdout")
    p.add_argument("--mode", choices=["colocated", "disaggregated"], default="colocated",
                   help="disaggregated: a prefill and a decode process connected over Mooncake TCP")
    p.add_argument("--host-pages", type=int, default=4096, help="decode host-tier pages (disaggregated)")
    for side in ("prefill", "decode"):
        p.add_argument(f"--{side}-tensor-parallel-size", type=int, metavar="N",
                       help=f"disaggregated: the {side} worker's ranks (default: --tensor-parallel-size)")


def _add_bench_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench", required=True)
    off = sub.add_parser("offline", help="tandem vs HF transformers generate on the same requests")
    add_engine_args(off)
    off.add_argument("--num-requests", type=int, default=64)
    off.add_argument("--max-batch-size", type=int, default=16, help="both systems batch at most this many")
    off.add_argument("--input-len", type=int, nargs=2, default=[64, 256], metavar=("MIN", "MAX"))
    off.add_argument("--output-len", type=int, nargs=2, default=[32, 128], metavar=("MIN", "MAX"))
    off.add_argument("--seed", type=int, default=0)
    off.add_argument("--skip-baseline", action="store_true", help="measure tandem only")
    off.add_argument("--repeats", type=int, default=1, help="alternate the systems N times; report each one's best")
    off.add_argument("--json", action="store_true", help="print the result as JSON too")
    xfer = sub.add_parser("transfer", help="raw Mooncake vs KV-through-tandem bandwidth, TTFT breakdown")
    add_engine_args(xfer)
    xfer.add_argument("--prompt-tokens", type=int, nargs="+", default=[512, 2048, 8192])
    xfer.add_argument("--seed", type=int, default=0)
    xfer.add_argument("--json", action="store_true", help="print the result as JSON too")
    add_load_args(sub.add_parser("serve", help="load any OpenAI-compatible endpoint (or a `tandem serve` started "
                                               "here): vLLM-style TTFT / TPOT / ITL / E2EL, goodput, sweeps"))
    _add_overload_args(sub.add_parser("overload", help="`tandem serve` at a multiple of its capacity: "
                                                       "fast 429s, and the TTFT of what it admits"))
    _add_hicache_args(sub.add_parser("hicache", help="the host KV tiers on vs off in one process: L2 multi-turn "
                                                     "TTFT and retract-heavy throughput, L3 TTFT after a restart"))
    _add_decode_args(sub.add_parser("decode", help="per-step decode latency and tok/s per batch size: eager vs "
                                                   "graph per attention backend, and HF generate"))
    _add_llamacpp_args(sub.add_parser("llamacpp", help="`tandem serve` vs llama.cpp's OpenAI server on the same fp32 "
                                                       "weights and threads: ITL, cold TTFT, concurrent tok/s"))
    _add_h2d_args(sub.add_parser("h2d", help="host -> device KV tier loads (the page copier) vs a plain pinned copy_ "
                                             "of the same bytes"))
    from cluster.bench.chaos import add_chaos_args

    add_chaos_args(sub.add_parser("chaos", help="`tandem serve` under steady load while workers and Redis are killed "
                                                "and KV is damaged at random: what every request became"))


def _add_overload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", help="load an already running server (http://host:port); default: start one here")
    p.add_argument("--config", metavar="FILE", help="cluster YAML of the server")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="passed to `tandem serve`")
    p.add_argument("--input-len", type=int, nargs=2, default=[64, 128], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[16, 32], metavar=("MIN", "MAX"))
    p.add_argument("--unloaded-requests", type=int, default=20, help="sent one at a time: the unloaded TTFT")
    p.add_argument("--capacity-rps", type=float, help="the server's sustainable requests/s (default: measured)")
    p.add_argument("--capacity-clients", type=int, default=16, help="closed-loop clients of the capacity run")
    p.add_argument("--capacity-s", type=float, default=30.0, help="length of the capacity run")
    p.add_argument("--factor", type=float, default=4.0, help="overload arrival rate / capacity")
    p.add_argument("--duration-s", type=float, default=60.0, help="length of the overload run (arrivals)")
    p.add_argument("--answer-within-s", type=float, default=2.0,
                   help="a 429 this soon after arrival; a first token this soon after the TTFT budget")
    p.add_argument("--ttft-budget-s", type=float,
                   help="the server's TTFT budget (default: router.max_queue_delay_s of the server's config)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ready-timeout-s", type=float, default=300.0, help="wait this long for /health/ready")
    p.add_argument("--json", action="store_true", help="print the result as JSON too")


def _add_hicache_args(p: argparse.ArgumentParser) -> None:
    p.description = ("The same workloads with the L2 host tier on, then off (host_cache_pages=0); then prompts "
                     "written to L3 (Redis) run on restarted engines with and without L3. Engine flags default to "
                     "EngineConfig's, except L1 (--num-pages) and L2, sized from each workload.")
    add_engine_args(p, defaults=False)
    p.add_argument("--conversations", type=int, default=6, help="multi-turn: conversations")
    p.add_argument("--turns", type=int, default=8, help="multi-turn: turns per conversation")
    p.add_argument("--turn-input-len", type=int, default=224, help="multi-turn: new user tokens per turn")
    p.add_argument("--turn-output-len", type=int, default=16, help="multi-turn: answer tokens per turn")
    p.add_argument("--l1-conversations", type=float, default=1.5,
                   help="multi-turn: L1 holds this many conversations' final histories")
    p.add_argument("--requests", type=int, default=8, help="retract-heavy: requests added at once")
    p.add_argument("--prompt-len", type=int, default=128, help="retract-heavy: prompt tokens per request")
    p.add_argument("--output-len", type=int, default=128, help="retract-heavy: output tokens per request")
    p.add_argument("--l1-fraction", type=float, default=0.3,
                   help="retract-heavy: L1 holds this fraction of all requests' peak KV")
    p.add_argument("--repeats", type=int, default=1,
                   help="retract-heavy: alternate L2 on / off N times; report each one's fastest run")
    p.add_argument("--l3-prompts", type=int, help="L3 after restart: prompts (default 2)")
    p.add_argument("--l3-prompt-len", type=int, help="L3 after restart: tokens per prompt (default 1500)")
    p.add_argument("--l3-url", metavar="URL", help="L3 after restart: a running Redis (redis://host:port/db); "
                                                   "default: a redis-server started for the phase")
    p.add_argument("--only", choices=["multiturn", "retract", "l3"], help="run one phase only")
    p.add_argument("--quick", action="store_true", help="small sizes (a smoke run), overriding the size flags")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="write the results as JSON to FILE")


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers (e.g. 1,8,32), got {text!r}") from None


def _add_decode_args(p: argparse.ArgumentParser) -> None:
    p.description = ("Each attention backend x batch size, eager then graph (--no-cuda-graph: eager only): B requests "
                     "prefilled untimed, then pure decode steps timed one by one; HF transformers generate on the "
                     "same prompts as the reference. --max-running and the graph buckets are set per batch size.")
    add_engine_args(p)
    p.add_argument("--batch-sizes", type=_int_list, metavar="B,B,...", help="default 1,8,32 (and 64 on cuda)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per run")
    p.add_argument("--warmup-steps", type=int, default=2, help="untimed decode steps before them")
    p.add_argument("--backends", type=lambda t: tuple(t.split(",")), metavar="NAME,...",
                   help="attention backends to time (default: all; those the device cannot run are skipped)")
    p.add_argument("--skip-hf", action="store_true", help="no HF transformers generate reference")
    p.add_argument("--random-weights", metavar="SHAPE",
                   help="instead of --model: a Llama of this shape (llama-3-8b, tiny) with seeded random weights "
                        "drawn on the device, no HF reference (cluster/bench/roofline.py)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="write the results as JSON to FILE")
    spec = p.add_argument_group("with --speculative eagle: plain vs speculative decoding, end to end, on held-out "
                                "chat prompts (default batch sizes 1,16)")
    spec.add_argument("--num-prompts", type=int, default=16, help="held-out chat prompts generated for per run")
    spec.add_argument("--max-tokens", type=int, default=128, help="output tokens per prompt at most")
    spec.add_argument("--repeats", type=int, default=2, help="rounds per batch size, alternating which system first")
    spec.add_argument("--adaptive", action="store_true",
                      help="also time EAGLE with the measured drafting policy (engine.speculative_adaptive)")
    spec.add_argument("--load-back", action="store_true",
                      help="instead: acceptance of second turns whose first turn was loaded back from the host tier")


def _add_llamacpp_args(p: argparse.ArgumentParser) -> None:
    p.description = ("llama.cpp's server (llama-server, C++, with --concurrency parallel slots; not a tandem "
                     "dependency), then `tandem serve`, one after the other on --threads threads each, over the same "
                     "/v1/completions requests: single-stream inter-token latency, cold TTFT of a long fresh prompt, "
                     "output tok/s at --concurrency, and the memory of every process of each server.")
    p.add_argument("--peer", choices=("llama-server", "llama-cpp-python"), default="llama-server",
                   help="llama.cpp's server: llama-server (C++, continuous batching) or llama-cpp-python's "
                        "(Python, one request at a time)")
    p.add_argument("--llama-server", metavar="PATH",
                   help="the llama-server binary (default: $TANDEM_LLAMA_SERVER, else llama-server on PATH)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="both servers' weights: tandem's engine.dtype, llama.cpp's GGUF "
                        "(bf16: matrices bf16, norms f32)")
    p.add_argument("--threads", type=int, default=2,
                   help="llama.cpp -t / -tb; tandem's workers share as many (split among them, lent when idle)")
    p.add_argument("--config", metavar="FILE", help="cluster YAML of the tandem server")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="passed to `tandem serve`")
    p.add_argument("--llamacpp-arg", action="append", default=[], metavar="ARG",
                   help="passed to the llama.cpp server's command line (repeatable; --llamacpp-arg=-fa ...)")
    p.add_argument("--gguf", metavar="FILE", help="llama.cpp's model (default: the bundled SmolLM2 as f32, made once)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens of the single-stream / concurrent runs")
    p.add_argument("--output-len", type=int, default=128, help="output tokens asked for in those runs")
    p.add_argument("--itl-runs", type=int, default=3, help="single streams, one at a time")
    p.add_argument("--ttft-prompt-len", type=int, default=1032, help="prompt tokens of the cold-TTFT requests")
    p.add_argument("--ttft-runs", type=int, default=3, help="cold-TTFT requests (fresh prompts), one at a time")
    p.add_argument("--repeats", type=int, default=1, help="rounds of both servers, alternating which goes first; "
                                                          "figures over all rounds' samples")
    p.add_argument("--concurrency", type=int, default=16, help="closed-loop clients of the throughput run")
    p.add_argument("--num-requests", type=int, default=32, help="requests of the throughput run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ready-timeout-s", type=float, default=300.0, help="wait this long for each server")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON to FILE")


def _add_h2d_args(p: argparse.ArgumentParser) -> None:
    from common.config import DTYPES

    p.add_argument("--device", default="cpu", help="the device pool's device (cuda on a GPU machine)")
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--pages", type=int, default=256, help="pages per load")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-layers", type=int, default=30, help="default: SmolLM2-135M's KV layout")
    p.add_argument("--num-kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5, help="loads of each kind, alternating; the best counts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="write the result as JSON to FILE")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    from cluster.serve.config_load import add_serve_args

    add_serve_args(sub.add_parser("serve", help="serve the OpenAI-compatible API from a Ray cluster"))
    _add_run_args(sub.add_parser("run", help="offline generation"))
    _add_bench_args(sub.add_parser("bench", help="benchmarks"))
    from cluster.train.cli import add_train_eagle_args

    add_train_eagle_args(sub.add_parser("train-eagle", help="distil an EAGLE-3 draft head for a model (CPU)"))
    from cluster.cli.restart import add_restart_args

    add_restart_args(sub.add_parser("restart", help="rolling restart of a running `tandem serve`'s workers "
                                    "(each drained first: its streams continue elsewhere)"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from cluster.serve.launch import ServeStartError
    from common.config import ConfigError

    try:
        if args.command == "serve":
            from cluster.serve.config_load import serve_config_from_args
            from cluster.serve.launch import serve

            if args.plan_only:
                from cluster.serve.launch import print_plan

                return print_plan(serve_config_from_args(args), args.plan_gpus, args.plan_gpu_memory_gib)
            if args.plan_gpus is not None or args.plan_gpu_memory_gib is not None:
                raise ConfigError("--plan-gpus and --plan-gpu-memory-gib go with --plan-only")
            return serve(serve_config_from_args(args))
        if args.command == "run":
            from cluster.cli.run import run_offline

            return run_offline(args)
        if args.command == "restart":
            from cluster.cli.restart import run_restart

            return run_restart(args)
        if args.command == "train-eagle":
            from cluster.train.cli import run_train_eagle

            return run_train_eagle(args)
        if args.bench == "transfer":
            from cluster.bench.transfer import bench_transfer

            return bench_transfer(args)
        if args.bench == "serve":
            from cluster.bench.load.runner import bench_load

            return bench_load(args)
        if args.bench == "overload":
            from cluster.bench.overload import bench_overload

            return bench_overload(args)
        if args.bench == "hicache":
            from cluster.bench.hicache import bench_hicache

            return bench_hicache(args)
        if args.bench == "decode" and args.speculative != "none":
            if args.random_weights:
                raise ConfigError("--random-weights times plain decoding: no --speculative")
            from cluster.bench.spec_decode import bench_spec_decode

            return bench_spec_decode(args)
        if args.bench == "decode":
            from cluster.bench.decode import bench_decode

            return bench_decode(args)
        if args.bench == "llamacpp":
            from cluster.bench.llamacpp import bench_llamacpp

            return bench_llamacpp(args)
        if args.bench == "h2d":
            from cluster.bench.h2d import bench_h2d

            return bench_h2d(args)
        if args.bench == "chaos":
            from cluster.bench.chaos import bench_chaos

            return bench_chaos(args)
        from cluster.bench.offline import bench_offline

        return bench_offline(args)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2
    except ServeStartError as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 1
