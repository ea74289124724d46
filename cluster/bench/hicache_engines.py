"""The engines of `tandem bench hicache`, shared by its phases (hicache.py: L2 on two workloads;
hicache_l3.py: L3 after a restart). The method, and how tokens are counted, are in hicache.py's docstring.

    EngineFactory, shared_model_factory   an engine for a config (with L3 when given), over one loaded model
    warm_engine                           one made and warmed up; on leaving: backups drained, KV checked, closed
    ForwardCounter                        the tokens an engine's forward passes have computed since a point
    run_one, steps_until_finished         one request alone to its end and its TTFT; steps that raise on a stall
    L2Sizing, on_off_configs              the L1 and L2 pages of a tier-on / tier-off pair of engines
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from cluster.bench import collect_engines
from common.config import EngineConfig, SamplingParams
from engine.request import FinishReason, Request, RequestStatus

if TYPE_CHECKING:
    from engine import EngineCore, StepOutput
    from kernels.model.loader import LoadedModel
    from kv_store.l3.config import L3Config

WARMUP_PROMPT = list(range(1, 17))  # first-call costs; random ids start at 10, so no prefix is shared
STALL_STEPS = 2000
"""Steps in a row with no forward pass and no host-tier copy in flight after which a run counts as
stalled (requests waiting that the engine never admits) and the bench raises instead of spinning."""

EngineFactory = Callable[[EngineConfig, "L3Config | None"], "EngineCore"]
"""Builds an engine for a config, with L3 when given (the bench: over SmolLM2 or --model; tests: over
the tiny model)."""


class ForwardCounter:
    """The tokens an engine's forward passes have computed since this was made (its graph runner counts them)."""

    def __init__(self, engine: EngineCore):
        self.engine, self._base = engine, engine.graph_stats().computed_tokens

    @property
    def num_tokens(self) -> int:
        return self.engine.graph_stats().computed_tokens - self._base


# ---- engines ----------------------------------------------------------------------------------------
def shared_model_factory() -> EngineFactory:
    """Engines over one loaded model: the first config loads it, later ones reuse it."""
    from engine import build_engine
    from kernels.kv_layout import TORCH_DTYPES
    from kernels.model.loader import load_model

    loaded: list[LoadedModel] = []

    def make(config, l3):
        if not loaded:
            loaded.append(load_model(config.model, device=config.device, dtype=TORCH_DTYPES[config.dtype],
                                     backend=config.attention_backend))
        m = loaded[0]
        collect_engines()
        return build_engine(config, m.model, m.arch, m.tokenizer, m.eos_token_ids, l3=l3)

    return make


@contextlib.contextmanager
def warm_engine(factory: EngineFactory, config: EngineConfig,
                l3: L3Config | None = None) -> Iterator[tuple[EngineCore, ForwardCounter]]:
    """A fresh, warmed-up engine and its forward counter; on leaving: backups drained, KV checked, closed."""
    engine = factory(config, l3)
    try:
        engine.generate([WARMUP_PROMPT], SamplingParams(max_tokens=2))
        counter = ForwardCounter(engine)
        yield engine, counter
        settle(engine)
        engine.check_integrity()
    finally:
        engine.close()


def settle(engine: EngineCore) -> None:
    while engine.busy():  # backups still in flight
        engine.step()


L2Sizing = Callable[[int, int], int]
"""(L1 pages, L2 pages sized from the workload) -> the L2 pages of the "on" run."""


def workload_l2(l1_pages: int, sized_pages: int) -> int:
    return sized_pages


def on_off_configs(base: EngineConfig, pages: tuple[int, int], l2: L2Sizing) -> tuple[EngineConfig, EngineConfig]:
    """(L2 on, L2 off) configs. L1 is `base.num_pages` when set, else `pages[0]`; L2 `l2(L1, pages[1])`."""
    l1 = base.num_pages or pages[0]
    host = l2(l1, pages[1])
    on, off = (dataclasses.replace(base, num_pages=l1, host_cache_pages=h) for h in (host if host >= 2 else 0, 0))
    return on, off


def ceil_pages(num_tokens: float, page_size: int) -> int:
    return math.ceil(num_tokens / page_size)


# ---- one request alone -----------------------------------------------------------------------------
def run_one(engine: EngineCore, counter: ForwardCounter, prompt: list[int],
            params: SamplingParams) -> tuple[Request, float]:
    """Run one request alone to its end: (the finished request, its TTFT in seconds)."""
    start_s = time.perf_counter()
    req = engine.add_request(prompt, params)
    ttft_s = None
    for outputs in steps_until_finished(engine, counter, [req]):
        if ttft_s is None and any(o.request_id == req.request_id and o.new_token_ids for o in outputs):
            ttft_s = time.perf_counter() - start_s
    if req.finish_reason is FinishReason.ABORT or ttft_s is None:
        raise RuntimeError(f"request {req.request_id} ({len(prompt)} prompt tokens) ended without output: {req.error}")
    return req, ttft_s


def steps_until_finished(engine: EngineCore, counter: ForwardCounter,
                         reqs: list[Request]) -> Iterator[list[StepOutput]]:
    """Each step's outputs until `reqs` have finished. Raises RuntimeError when the engine stalls:
    `STALL_STEPS` steps in a row with no forward pass and no host-tier copy in flight."""
    idle = 0
    while any(r.status is not RequestStatus.FINISHED for r in reqs):
        before = counter.num_tokens
        yield engine.step()
        idle = 0 if counter.num_tokens > before or engine.housekeeping_due() else idle + 1
        if idle >= STALL_STEPS:
            waiting, loading, running, pool = engine.occupancy()
            raise RuntimeError(f"engine stalled: no forward pass and no copy in flight for {idle} steps with "
                               f"{waiting} requests waiting, {loading} loading, {running} running; device pool {pool}")


def mean_or_zero(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0
