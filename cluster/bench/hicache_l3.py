"""`tandem bench hicache`, phase 3: time to first token from L3 after every worker restarted.

An engine with L3 prefills `--l3-prompts` prompts and is closed once L3 has their pages. Then two
engines start empty, as after a restart: one without L3 (cold: computes the whole prompt) and one with
L3 (a request's prefetch brings its pages L3 -> L2 -> L1, `wait_complete`; only the rest is computed).
The engines, forward counting and TTFT come from `cluster.bench.hicache_engines`; the method is in
`cluster.bench.hicache`'s docstring.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import math
import random
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cluster.bench.hicache_engines import (
    EngineFactory,
    ForwardCounter,
    L2Sizing,
    ceil_pages,
    mean_or_zero,
    on_off_configs,
    run_one,
    settle,
    warm_engine,
    workload_l2,
)
from common.config import EngineConfig, SamplingParams
from kv_store.l3.config import L3Config, redact_url

if TYPE_CHECKING:
    from common.protocol import TierStats
    from engine import EngineCore
    from engine.request import Request

log = logging.getLogger("tandem.bench")

L3_OP_TIMEOUT_S = 5.0
"""Per Redis call (L3Config.op_timeout_s). Generous: a call that runs out is an L3 error and its pages
misses, and the phase would time the fault path instead of L3 reads."""
L3_FLUSH_TIMEOUT_S = 120.0
L3_KEY_TTL_S = 3600
FIRST_TOKEN = SamplingParams(max_tokens=1)


@dataclass(frozen=True)
class L3Spec:
    prompts: int
    prompt_tokens: int
    seed: int = 0


@dataclass(frozen=True)
class RestartResult:
    """One prompt on the two restarted engines: cold (no L3) and with L3."""

    prompt_tokens: int
    ttft_cold_s: float
    ttft_l3_s: float
    first_token_cold: int
    first_token_l3: int
    cached_tokens_cold: int
    cached_tokens_l3: int  # served by the prefix cache on the L3 engine
    l3_hit_tokens: int  # of those, brought by an L3 prefetch
    computed_tokens_l3: int  # the L3 engine's forward tokens for it


@dataclass(frozen=True)
class L3Traffic:
    """One engine's L3 figures between two points (differences of its tier stats)."""

    put_pages: int
    put_s: float
    get_pages: int
    get_s: float
    errors: int
    corrupt: int
    prefetches: dict[str, int]  # outcome -> count

    @classmethod
    def between(cls, before: TierStats, after: TierStats) -> L3Traffic:
        earlier = dict(before.prefetches)
        return cls(after.l3_put_pages - before.l3_put_pages, after.l3_put_seconds - before.l3_put_seconds,
                   after.l3_get_pages - before.l3_get_pages, after.l3_get_seconds - before.l3_get_seconds,
                   after.l3_errors - before.l3_errors, after.l3_corrupt - before.l3_corrupt,
                   {k: n - earlier.get(k, 0) for k, n in after.prefetches if n > earlier.get(k, 0)})


@dataclass(frozen=True)
class L3Run:
    l1_pages: int
    l2_pages: int
    prompts: list[RestartResult]
    written: L3Traffic  # the writer's, over the prompts (its warm-up left out)
    read: L3Traffic  # the restarted L3 engine's, over the prompts


# ---- 3. L3 after restart --------------------------------------------------------------------------
def l3_pages(spec: L3Spec, page_size: int) -> tuple[int, int]:
    """(L1, L2) pages: L1 holds one prompt and its first token; L2 every prompt with a quarter spare (the
    writer keeps each until L3 has it, the restarted engine lands its prefetches there); + scratch pages."""
    one = ceil_pages(spec.prompt_tokens + 1, page_size)
    return one + 1, math.ceil(1.25 * spec.prompts * one) + 1


def l3_prompts(spec: L3Spec, vocab_size: int) -> list[list[int]]:
    rng = random.Random(spec.seed)
    return [[rng.randrange(10, vocab_size) for _ in range(spec.prompt_tokens)] for _ in range(spec.prompts)]


def bench_l3_config(url: str) -> L3Config:
    """L3 of the phase: requests wait for their prefetch; keys under a prefix of this run's own, expiring."""
    return L3Config(url=url, prefetch_policy="wait_complete", op_timeout_s=L3_OP_TIMEOUT_S,
                    key_prefix=f"tandem:bench:{uuid.uuid4().hex[:12]}:", ttl_s=L3_KEY_TTL_S)


def _l3_flushed(engine: EngineCore) -> TierStats:
    """The engine's tier stats once its backups and L3 writes so far are done."""
    settle(engine)
    if not engine.flush_l3(L3_FLUSH_TIMEOUT_S):
        raise RuntimeError(f"L3 writes not sent after {L3_FLUSH_TIMEOUT_S} s: is Redis answering?")
    return engine.tier_stats()


def _first_token(engine: EngineCore, counter: ForwardCounter, prompt: list[int]) -> tuple[Request, float, int, int]:
    """(the request, its TTFT, tokens an L3 prefetch brought it, its forward tokens), run alone."""
    l3_hits, forward = engine.tier_stats().hit_tokens_l3, counter.num_tokens
    req, ttft_s = run_one(engine, counter, prompt, FIRST_TOKEN)
    settle(engine)
    return req, ttft_s, engine.tier_stats().hit_tokens_l3 - l3_hits, counter.num_tokens - forward


def _restarted_prompt(cold: tuple[EngineCore, ForwardCounter], with_l3: tuple[EngineCore, ForwardCounter],
                      prompt: list[int]) -> RestartResult:
    c_req, c_ttft_s, _, _ = _first_token(*cold, prompt)
    req, ttft_s, l3_hits, computed = _first_token(*with_l3, prompt)
    return RestartResult(len(prompt), c_ttft_s, ttft_s, c_req.output_token_ids[0], req.output_token_ids[0],
                         c_req.cached_tokens, req.cached_tokens, l3_hits, computed)


def compare_l3(factory: EngineFactory, base: EngineConfig, spec: L3Spec, url: str,
               l2: L2Sizing = workload_l2) -> L3Run:
    """Prefill the prompts on an engine with L3 at `url` and close it; then run each prompt on two fresh
    engines, cold (no L3) and then with L3."""
    with_l3, cold = on_off_configs(base, l3_pages(spec, base.page_size), l2)
    with_l3, l3 = dataclasses.replace(with_l3, write_policy="write_through"), bench_l3_config(url)
    with warm_engine(factory, with_l3, l3) as (writer, counter):
        prompts = l3_prompts(spec, writer.arch.vocab_size)
        before = _l3_flushed(writer)
        for prompt in prompts:
            _first_token(writer, counter, prompt)
        written = L3Traffic.between(before, _l3_flushed(writer))
    log.info("L3 after restart: %d pages written, restarting", written.put_pages)
    with warm_engine(factory, cold) as off, warm_engine(factory, with_l3, l3) as on:
        before, results = _l3_flushed(on[0]), []
        for prompt in prompts:
            results.append(_restarted_prompt(off, on, prompt))
            log.info("L3 after restart: prompt %d/%d, TTFT cold %.2f s, from L3 %.2f s", len(results), len(prompts),
                     results[-1].ttft_cold_s, results[-1].ttft_l3_s)
        read = L3Traffic.between(before, _l3_flushed(on[0]))
    assert with_l3.num_pages is not None and with_l3.host_cache_pages is not None, "on_off_configs sets both"
    return L3Run(with_l3.num_pages, with_l3.host_cache_pages, results, written, read)


@contextlib.contextmanager
def _redis(url: str | None) -> Iterator[tuple[str, str]]:
    """(url, where it points): `url` as given, or that of a redis-server started here and stopped on leaving."""
    if url:
        yield url, redact_url(url)
        return
    from kv_store.l3.redis_process import RedisServer

    with tempfile.TemporaryDirectory(prefix="tandem-bench-redis-") as work_dir:
        server = RedisServer(Path(work_dir)).start()
        try:
            yield server.url, f"redis-server started by the bench on port {server.port}"
        finally:
            server.stop()


def l3_phase(args: argparse.Namespace, factory: EngineFactory, base: EngineConfig, spec: L3Spec,
             l2: L2Sizing = workload_l2) -> dict:
    """The phase's summary (printed); {"skipped": why} when there is no Redis to use, or under
    `--only l3` FileNotFoundError."""
    from kv_store.l3.redis_process import redis_server_path

    url = vars(args).get("l3_url")
    if not url and redis_server_path() is None:
        why = "redis-server is not installed (Debian package redis-server) and no --l3-url was given"
        if args.only == "l3":
            raise FileNotFoundError(f"--only l3: {why}")
        print(f"\nL3 after restart: skipped, {why}")
        return {"skipped": why}
    with _redis(url) as (url, where):
        summary = l3_summary(spec, compare_l3(factory, base, spec, url, l2), where)
    print_l3(summary)
    return summary


def l3_summary(spec: L3Spec, run: L3Run, redis: str) -> dict:
    cold, from_l3 = (mean_or_zero([getattr(p, f) for p in run.prompts]) for f in ("ttft_cold_s", "ttft_l3_s"))
    w, r = run.written, run.read
    return {"workload": {**asdict(spec), "l1_pages": run.l1_pages, "l2_pages": run.l2_pages, "redis": redis},
            "prompts": [asdict(p) for p in run.prompts], "ttft_cold_mean_s": cold, "ttft_l3_mean_s": from_l3,
            "ttft_ratio_cold_over_l3": cold / from_l3 if from_l3 else None,
            "l3_hit_tokens": sum(p.l3_hit_tokens for p in run.prompts),
            "writer": {**asdict(w), "put_ms_per_page": 1e3 * w.put_s / w.put_pages if w.put_pages else None},
            "restarted": {**asdict(r), "get_ms_per_page": 1e3 * r.get_s / r.get_pages if r.get_pages else None},
            "first_tokens_identical": all(p.first_token_cold == p.first_token_l3 for p in run.prompts)}


def print_l3(s: dict) -> None:
    w, put, get = s["workload"], s["writer"], s["restarted"]
    print(f"\nL3 after restart: {w['prompts']} prompts x {w['prompt_tokens']} tokens prefilled by an engine with L3, "
          f"then closed; each prompt alone on two fresh engines (L1/L2 empty), without L3 (cold) and with L3 "
          f"(prefetch wait_complete); L1 {w['l1_pages']} pages, L2 {w['l2_pages']} pages; {w['redis']}")
    print(f"{'prompt':>6}{'prompt_tok':>12}{'ttft_cold_s':>13}{'ttft_l3_s':>11}{'cached_l3':>11}{'l3_hit_tok':>12}"
          f"{'computed_l3':>13}")
    for i, p in enumerate(s["prompts"]):
        print(f"{i:>6}{p['prompt_tokens']:>12}{p['ttft_cold_s']:>13.3f}{p['ttft_l3_s']:>11.3f}"
              f"{p['cached_tokens_l3']:>11}{p['l3_hit_tokens']:>12}{p['computed_tokens_l3']:>13}")
    ratio = s["ttft_ratio_cold_over_l3"]
    print(f"TTFT mean: cold {s['ttft_cold_mean_s']:.3f} s, from L3 {s['ttft_l3_mean_s']:.3f} s; ratio cold / from L3: "
          + (f"{ratio:.2f}x" if ratio else "n/a"))
    print(f"L3 put (writer): {put['put_pages']} pages, {_ms(put['put_ms_per_page'])}/page; get (restarted): "
          f"{get['get_pages']} pages, {_ms(get['get_ms_per_page'])}/page; errors {put['errors'] + get['errors']}, "
          f"corrupt {put['corrupt'] + get['corrupt']}; prefetches {get['prefetches'] or 'none'}")
    print(f"greedy first tokens identical cold / from L3: {'yes' if s['first_tokens_identical'] else 'NO'}")


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f} ms"
