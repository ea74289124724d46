"""The engine's command-line flags, declared once beside `EngineConfig` (argparse is the standard
library): `tandem run`, `tandem bench ...` and `tandem serve` add them, and the serve config
(`cluster/serve/config.py`) reads them, without importing the CLI."""

from __future__ import annotations

import argparse

from common.config import ATTENTION_BACKENDS, DTYPES, SPECULATIVE_METHODS, WRITE_POLICIES, EngineConfig

# flag -> (EngineConfig field, argparse options): the engine flags of `tandem run`, `tandem bench`
# and `tandem serve`, declared once
ENGINE_FLAGS: dict[str, tuple[str, dict]] = {
    "--model": ("model", dict(help="'smollm2' (bundled SmolLM2-135M-Instruct) or a local HF dir")),
    "--device": ("device", dict(help="engine device, e.g. cpu or cuda")),
    "--dtype": ("dtype", dict(choices=DTYPES, help="engine dtype")),
    "--attention-backend": ("attention_backend", dict(choices=ATTENTION_BACKENDS,
                                                      help="attention kernels (auto: flashinfer, else triton on CUDA; "
                                                           "torch on CPU)")),
    "--page-size": ("page_size", dict(type=int, help="tokens per KV page (power of two)")),
    "--chunk-size": ("chunk_size", dict(type=int, help="prefill tokens per scheduler step")),
    "--num-pages": ("num_pages", dict(type=int, help="KV pages per pool (default: sized from kv_memory_gib)")),
    "--max-running": ("max_running_requests", dict(type=int, metavar="N", help="requests decoded together at most")),
    "--no-prefix-cache": ("enable_prefix_cache", dict(action="store_const", const=False,
                                                      help="disable radix prefix caching")),
    "--host-cache-ratio": ("host_cache_ratio", dict(type=float, metavar="R",
                                                    help="L2 host-memory KV pages per device page (0: no host tier)")),
    "--host-cache-pages": ("host_cache_pages", dict(type=int, metavar="N",
                                                    help="L2 host pages, overriding --host-cache-ratio (0: none)")),
    "--write-policy": ("write_policy", dict(choices=WRITE_POLICIES, help="when device KV gets its host copy")),
    "--no-cuda-graph": ("cuda_graph", dict(action="store_const", const=False,
                                           help="run every decode step eagerly (no graph replay)")),
    "--cpu-compile": ("cpu_compile", dict(action="store_const", const=True,
                                          help="CPU: run single-request decode steps through torch.compile "
                                               "(compiled once at start-up; on by default in tandem serve)")),
    "--no-cpu-compile": ("cpu_compile", dict(action="store_const", const=False,
                                             help="CPU: run every decode step eagerly (no compile at start-up)")),
    "--no-cpu-native-decode": ("cpu_native_decode", dict(action="store_const", const=False,
                                                        help="CPU: decode steps of up to 4 requests run torch's "
                                                             "layers (compiled with --cpu-compile), not the C layer")),
    "--no-cpu-prepack": ("cpu_prepack", dict(action="store_const", const=False,
                                             help="CPU: do not keep weights in oneDNN's packed layout too")),
    "--tensor-parallel-size": ("tensor_parallel_size", dict(
        type=int, metavar="N", aliases=("-tp",), help="split the model over N ranks, a process each (gloo on "
                                                      "the CPU, NCCL on CUDA: one GPU a rank)")),
    "--speculative": ("speculative", dict(choices=SPECULATIVE_METHODS,
                                          help="speculative decoding: eagle drafts tokens with an EAGLE head, "
                                               "the model verifies them (same output)")),
    "--draft-model": ("draft_model", dict(metavar="PATH", help="EAGLE head directory (default: the one "
                                                                 "`tandem train-eagle` cached for --model, else "
                                                                 "the one shipped for smollm2)")),
    "--num-draft-tokens": ("num_draft_tokens", dict(type=int, metavar="K",
                                                    help="draft tokens per step "
                                                         "(the tree's depth with --speculative-topk)")),
    "--speculative-topk": ("speculative_topk", dict(type=int, metavar="W",
                                                    help="tree drafting: W nodes per level, W x K verified at once "
                                                         "(1: a chain)")),
    "--speculative-tree-nodes": ("speculative_tree_nodes", dict(
        type=int, metavar="N", help="tree drafting: verify the N likeliest candidates (0: W x K)")),
    "--speculative-max-batch": ("speculative_max_batch", dict(type=int, metavar="N",
                                                              help="draft only while at most N requests run")),
    "--no-speculative-adaptive": ("speculative_adaptive", dict(
        action="store_const", const=False, help="draft at every batch size up to --speculative-max-batch, "
                                                 "even where measured decoding without drafts is faster")),
}


def add_engine_args(p: argparse.ArgumentParser, *, defaults: bool = True, note: str = "") -> None:
    """The engine flags. `defaults`: each flag defaults to EngineConfig's value (run, bench); else to
    None, meaning "not given" (serve: only given flags override the config file). `note` ends each help."""
    engine = EngineConfig()
    for flag, (field, options) in ENGINE_FLAGS.items():
        default = getattr(engine, field) if defaults else None
        shown = f" (default {default})" if default is not None and "action" not in options else ""
        names = (flag, *options.get("aliases", ()))
        options = {k: v for k, v in options.items() if k != "aliases"}
        p.add_argument(*names, dest=field, default=default, **{**options, "help": options["help"] + shown + note})


def engine_fields_from_args(args: argparse.Namespace) -> dict:
    """The EngineConfig fields the engine flags gave (None: not given)."""
    return {field: getattr(args, field) for field, _ in ENGINE_FLAGS.values() if getattr(args, field) is not None}
