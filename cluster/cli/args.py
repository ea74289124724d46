"""Command-line pieces shared by the `tandem` subcommands and the benches that parse them (kept apart
from `main`, so a bench never imports the entry point that imports it)."""

from __future__ import annotations

import argparse

from cluster.config import EngineConfig


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine flags of `tandem run` and `tandem bench offline|transfer`."""
    p.add_argument("--model", default="smollm2", help="'smollm2' (bundled SmolLM2-135M-Instruct) or a local HF dir")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page (power of two)")
    p.add_argument("--chunk-size", type=int, default=512, help="prefill tokens per scheduler step")
    p.add_argument("--num-pages", type=int, default=None, help="KV pages in the pool (default: sized from memory)")
    p.add_argument("--max-running", type=int, default=64, help="requests decoded together at most")
    p.add_argument("--no-prefix-cache", action="store_true", help="disable radix prefix caching")


def engine_config_from_args(args: argparse.Namespace, **overrides) -> EngineConfig:
    fields = dict(model=args.model, device=args.device, dtype=args.dtype, page_size=args.page_size,
                  chunk_size=args.chunk_size, num_pages=args.num_pages, max_running_requests=args.max_running,
                  enable_prefix_cache=not args.no_prefix_cache)
    return EngineConfig(**{**fields, **overrides})
