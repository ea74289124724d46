"""`tandem bench hicache`: the host KV tiers on vs off, in one process: L2 on two workloads, L3 after a restart.

Each L2 workload runs on two in-process `EngineCore`s over the same model: one with the host tier
(`host_cache_pages` > 0), one without (`host_cache_pages=0`, L1 prefix cache only). The device pool
(L1, `num_pages`) is sized from the workload so that it cannot keep everything: what L1 evicts goes
to L2 and is loaded back, or (L2 off) is computed again. The two runs alternate (per request in the
multi-turn workload, per repeat in the retract one), so drift in machine load hits both alike.

1. Multi-turn. C conversations of T turns; turn t's prompt is

       | user 1 | answer 1 | ... | user t-1 | answer t-1 | user t |

   where `user i` are seeded random token ids and `answer i` the tokens this run generated for turn i
   (greedy, exact length). Rounds interleave the conversations (turn 1 of each, then turn 2 of each,
   ...) and a round runs its requests one at a time, each on the L2-on engine and then on the L2-off
   one, so TTFT = add_request -> the step that returns the request's first token, with nothing else
   in the batch. Between requests an engine's backups are drained (untimed), so one engine's copies
   never overlap the other's request. L1 holds `--l1-conversations` final histories, so a
   conversation's prefix has left L1 by its next turn.
2. Retract-heavy. N requests with long outputs, all added at once, on an L1 holding `--l1-fraction`
   of their peak KV: the scheduler retracts, and a retracted request resumes from the prefix tree
   (L2 on: loaded back; off: whatever L1 kept, the rest recomputed). With `--repeats` the two
   alternate that many times and each reports its fastest run (the token counts do not vary).
3. L3 after restart. An engine with L3 (Redis) prefills N prompts of P seeded random tokens, waits
   until L3 has their pages, and is closed. Then two engines start empty, as after restarting every
   worker: one without L3 (cold: computes the whole prompt) and one with L3 (a request's prefetch
   brings its pages L3 -> L2 -> L1, `wait_complete`, and only the rest is computed). Each prompt runs
   alone on the cold engine and then on the L3 one; TTFT as above, one output token. L1 holds one
   prompt, L2 all of them; the writer backs every page up (`write_through`, whatever --write-policy
   says). Redis is `--l3-url`, else a redis-server started for the phase (free loopback port, temp
   dir) and stopped after; with neither at hand the phase is skipped with a printed line (under
   `--only l3`: an error). Keys get a prefix of the run's own and expire after an hour, so a shared
   server neither serves an earlier run's pages nor keeps these.

Computed tokens are counted on the engine's forward passes. A request with prompt P and output O
computes P + O - 1 tokens when nothing is cached and nothing is retracted (its last token is never
fed back); a multi-turn turn's computed prefill is its forward tokens minus its O - 1 decode tokens,
and the retract workload's recomputed tokens are all forward tokens minus sum(P + O - 1).

Every engine ends with its backups drained and `engine.check_integrity()`. A run whose engine stops
making progress (`STALL_STEPS`) raises instead of spinning.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import random
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cluster.config import EngineConfig, SamplingParams
from kv_store.l3.config import L3Config, redact_url
from prefill_worker.engine.request import FinishReason, Request, RequestStatus

if TYPE_CHECKING:
    from cluster.protocol import TierStats
    from prefill_worker.engine import EngineCore, StepOutput

log = logging.getLogger("tandem.bench")

WARMUP_PROMPT = list(range(1, 17))  # first-call costs; random ids start at 10, so no prefix is shared
STALL_STEPS = 2000
"""Steps in a row with no forward pass and no host-tier copy in flight after which a run counts as
stalled (requests waiting that the engine never admits) and the bench raises instead of spinning."""
L3_OP_TIMEOUT_S = 5.0
"""Per Redis call (L3Config.op_timeout_s). Generous: a call that runs out is an L3 error and its pages
misses, and the phase would time the fault path instead of L3 reads."""
L3_FLUSH_TIMEOUT_S = 120.0
L3_KEY_TTL_S = 3600
FIRST_TOKEN = SamplingParams(max_tokens=1)
SCHEDULE_NOTE = ("conversations interleaved per round; one request at a time (TTFT unbatched), alternating L2 on / off "
                 "request by request")


@dataclass(frozen=True)
class MultiTurnSpec:
    conversations: int
    turns: int
    user_tokens: int  # new user tokens per turn
    output_tokens: int  # generated tokens per turn (exact: ignore_eos)
    l1_conversations: float  # L1 holds this many final histories
    seed: int = 0

    @property
    def final_tokens(self) -> int:
        """The last turn's prompt + answer: the longest a conversation's KV gets."""
        return self.turns * (self.user_tokens + self.output_tokens)


@dataclass(frozen=True)
class RetractSpec:
    requests: int
    prompt_tokens: int
    output_tokens: int
    l1_fraction: float  # L1 holds this fraction of all requests' peak KV
    seed: int = 0


@dataclass(frozen=True)
class TurnResult:
    conversation: int
    turn: int  # 1-based
    prompt_tokens: int
    cached_tokens: int  # served by the prefix cache, any tier
    host_hit_tokens: int  # of those, loaded back from L2
    computed_prefill_tokens: int  # forward tokens of the turn minus its decode tokens
    ttft_s: float


@dataclass(frozen=True)
class MultiTurnRun:
    l2_pages: int
    l1_pages: int
    turns: list[TurnResult]
    outputs: list[list[list[int]]]  # [conversation][turn] -> generated token ids
    elapsed_s: float  # its requests' time, add_request -> finished, summed

    def later(self) -> list[TurnResult]:
        return [t for t in self.turns if t.turn >= 2]

    @property
    def ttft_mean_later_s(self) -> float:
        return _mean([t.ttft_s for t in self.later()])

    def total(self, field: str, later: bool = True) -> int:
        return sum(getattr(t, field) for t in (self.later() if later else self.turns))


@dataclass(frozen=True)
class RetractRun:
    l2_pages: int
    l1_pages: int
    elapsed_s: float
    output_tokens: int
    forward_tokens: int
    min_forward_tokens: int  # sum(P + O - 1): every request computed once, nothing recomputed
    retractions: int
    l2_hit_tokens: int
    outputs: list[list[int]]

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def recomputed_tokens(self) -> int:
        return self.forward_tokens - self.min_forward_tokens


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


EngineFactory = Callable[[EngineConfig, "L3Config | None"], "EngineCore"]
"""Builds an engine for a config, with L3 when given (the bench: over SmolLM2 or --model; tests: over
the tiny model)."""


class _CountingRunner:
    """The engine's ModelRunner, counting the tokens its forward passes compute."""

    def __init__(self, runner):
        self.runner, self.num_tokens = runner, 0

    def forward(self, rows):
        self.num_tokens += sum(len(r.token_ids) for r in rows)
        return self.runner.forward(rows)

    def __getattr__(self, name: str):
        return getattr(self.runner, name)


# ---- engines ----------------------------------------------------------------------------------------
def shared_model_factory() -> EngineFactory:
    """Engines over one loaded model: the first config loads it, later ones reuse it."""
    from kernels.kv_layout import TORCH_DTYPES
    from kernels.model.loader import load_model
    from prefill_worker.engine import EngineCore

    loaded = []

    def make(config, l3):
        if not loaded:
            loaded.append(load_model(config.model, device=config.device, dtype=TORCH_DTYPES[config.dtype],
                                     backend=config.attention_backend))
        m = loaded[0]
        return EngineCore(config, m.model, m.arch, m.tokenizer, m.eos_token_ids, l3=l3)

    return make


@contextlib.contextmanager
def _engine(factory: EngineFactory, config: EngineConfig,
            l3: L3Config | None = None) -> Iterator[tuple[EngineCore, _CountingRunner]]:
    """A fresh, warmed-up engine and its forward counter; on leaving: backups drained, KV checked, closed."""
    engine = factory(config, l3)
    try:
        engine.generate([WARMUP_PROMPT], SamplingParams(max_tokens=2))
        counter = engine.runner = _CountingRunner(engine.runner)
        yield engine, counter
        _settle(engine)
        engine.check_integrity()
    finally:
        engine.close()


def _settle(engine: EngineCore) -> None:
    while engine.busy():  # backups still in flight
        engine.step()


L2Sizing = Callable[[int, int], int]
"""(L1 pages, L2 pages sized from the workload) -> the L2 pages of the "on" run."""


def workload_l2(l1_pages: int, sized_pages: int) -> int:
    return sized_pages


def _on_off_configs(base: EngineConfig, pages: tuple[int, int], l2: L2Sizing) -> tuple[EngineConfig, EngineConfig]:
    """(L2 on, L2 off) configs. L1 is `base.num_pages` when set, else `pages[0]`; L2 `l2(L1, pages[1])`."""
    l1 = base.num_pages or pages[0]
    host = l2(l1, pages[1])
    on, off = (dataclasses.replace(base, num_pages=l1, host_cache_pages=h) for h in (host if host >= 2 else 0, 0))
    return on, off


def _ceil_pages(num_tokens: float, page_size: int) -> int:
    return math.ceil(num_tokens / page_size)


# ---- 1. multi-turn --------------------------------------------------------------------------------
def multiturn_pages(spec: MultiTurnSpec, page_size: int) -> tuple[int, int]:
    """(L1, L2) pages: L1 holds `l1_conversations` final histories (at least one whole request) + the
    scratch page; L2 holds every conversation's (a quarter spare for partial pages) + its scratch page."""
    final = spec.final_tokens
    l1 = max(_ceil_pages(spec.l1_conversations * final, page_size), _ceil_pages(final, page_size)) + 1
    return l1, _ceil_pages(1.25 * spec.conversations * final, page_size) + 1


def user_turns(spec: MultiTurnSpec, vocab_size: int) -> list[list[list[int]]]:
    rng = random.Random(spec.seed)
    return [[[rng.randrange(10, vocab_size) for _ in range(spec.user_tokens)] for _ in range(spec.turns)]
            for _ in range(spec.conversations)]


class _Conversations:
    """One engine's side of the multi-turn workload: its histories and results so far."""

    def __init__(self, engine: EngineCore, counter: _CountingRunner, spec: MultiTurnSpec):
        self.engine, self.counter = engine, counter
        self.params = SamplingParams(max_tokens=spec.output_tokens, ignore_eos=True)
        self.histories: list[list[int]] = [[] for _ in range(spec.conversations)]
        self.outputs: list[list[list[int]]] = [[] for _ in range(spec.conversations)]
        self.turns: list[TurnResult] = []
        self.elapsed_s = 0.0

    def take_turn(self, c: int, user: list[int]) -> None:
        """Conversation `c`'s next turn, alone on the engine; then its backups are drained (untimed)."""
        prompt = self.histories[c] + user
        before, start_s = self.counter.num_tokens, time.perf_counter()
        req, ttft_s = _run_one(self.engine, self.counter, prompt, self.params)
        self.elapsed_s += time.perf_counter() - start_s
        computed = self.counter.num_tokens - before - (len(req.output_token_ids) - 1)
        self.turns.append(TurnResult(c, len(self.outputs[c]) + 1, len(prompt), req.cached_tokens,
                                     req.host_hit_tokens, computed, ttft_s))
        self.outputs[c].append(req.output_token_ids)
        self.histories[c] = prompt + req.output_token_ids
        _settle(self.engine)

    def result(self) -> MultiTurnRun:
        config = self.engine.config
        return MultiTurnRun(config.host_cache_pages, config.num_pages, self.turns, self.outputs, self.elapsed_s)


def _run_one(engine: EngineCore, counter: _CountingRunner, prompt: list[int],
             params: SamplingParams) -> tuple[Request, float]:
    """Run one request alone to its end: (the finished request, its TTFT in seconds)."""
    start_s = time.perf_counter()
    req = engine.add_request(prompt, params)
    ttft_s = None
    for outputs in _steps(engine, counter, [req]):
        if ttft_s is None and any(o.request_id == req.request_id and o.new_token_ids for o in outputs):
            ttft_s = time.perf_counter() - start_s
    if req.finish_reason is FinishReason.ABORT or ttft_s is None:
        raise RuntimeError(f"request {req.request_id} ({len(prompt)} prompt tokens) ended without output: {req.error}")
    return req, ttft_s


def _steps(engine: EngineCore, counter: _CountingRunner, reqs: list[Request]) -> Iterator[list[StepOutput]]:
    """Each step's outputs until `reqs` have finished. Raises RuntimeError when the engine stalls:
    `STALL_STEPS` steps in a row with no forward pass and no host-tier copy in flight."""
    idle = 0
    while any(r.status is not RequestStatus.FINISHED for r in reqs):
        before = counter.num_tokens
        yield engine.step()
        idle = 0 if counter.num_tokens > before or engine.host_cache.busy() else idle + 1
        if idle >= STALL_STEPS:
            s = engine.scheduler
            raise RuntimeError(f"engine stalled: no forward pass and no copy in flight for {idle} steps with "
                               f"{len(s.waiting)} requests waiting, {len(s.loading)} loading, {len(s.running)} "
                               f"running; device pool {engine.kvm.pool.usage()}")


def compare_multiturn(factory: EngineFactory, base: EngineConfig, spec: MultiTurnSpec,
                      l2: L2Sizing = workload_l2) -> tuple[MultiTurnRun, MultiTurnRun]:
    """(L2 on, L2 off) on the same conversations, request by request alternating between the two."""
    configs = _on_off_configs(base, multiturn_pages(spec, base.page_size), l2)
    with contextlib.ExitStack() as stack:
        sides = [_Conversations(*stack.enter_context(_engine(factory, config)), spec) for config in configs]
        users = user_turns(spec, sides[0].engine.arch.vocab_size)
        start_s = time.perf_counter()
        for turn in range(spec.turns):
            for c in range(spec.conversations):
                for side in sides:
                    side.take_turn(c, users[c][turn])
            log.info("multi-turn: round %d/%d done, %.1f s (L2 on %.1f s, off %.1f s)", turn + 1, spec.turns,
                     time.perf_counter() - start_s, sides[0].elapsed_s, sides[1].elapsed_s)
        on, off = (side.result() for side in sides)
    return on, off


# ---- 2. retract-heavy -----------------------------------------------------------------------------
def retract_pages(spec: RetractSpec, page_size: int) -> tuple[int, int]:
    """(L1, L2) pages: L1 holds `l1_fraction` of all requests' peak KV (at least one whole request);
    L2 all of it with a quarter spare; + the scratch pages."""
    one = _ceil_pages(spec.prompt_tokens + spec.output_tokens, page_size)
    l1 = max(math.ceil(spec.l1_fraction * spec.requests * one), one) + 1
    return l1, math.ceil(1.25 * spec.requests * one) + 1


def retract_prompts(spec: RetractSpec, vocab_size: int) -> list[list[int]]:
    rng = random.Random(spec.seed)
    return [[rng.randrange(10, vocab_size) for _ in range(spec.prompt_tokens)] for _ in range(spec.requests)]


def run_retract(engine: EngineCore, counter: _CountingRunner, spec: RetractSpec) -> RetractRun:
    prompts = retract_prompts(spec, engine.arch.vocab_size)
    retractions, hits = engine.num_retractions, engine.host_cache.counters.l2_hit_tokens
    start_s = time.perf_counter()
    params = SamplingParams(max_tokens=spec.output_tokens, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in prompts]
    for _ in _steps(engine, counter, reqs):
        pass
    elapsed_s = time.perf_counter() - start_s
    outputs = [r.output_token_ids for r in reqs]
    if any(len(o) != spec.output_tokens for o in outputs):
        raise RuntimeError(f"asked for {spec.output_tokens} tokens each, got {sorted(map(len, outputs))}: aborted?")
    return RetractRun(engine.config.host_cache_pages, engine.config.num_pages, elapsed_s, sum(map(len, outputs)),
                      counter.num_tokens, sum(len(p) + spec.output_tokens - 1 for p in prompts),
                      engine.num_retractions - retractions, engine.host_cache.counters.l2_hit_tokens - hits, outputs)


def compare_retract(factory: EngineFactory, base: EngineConfig, spec: RetractSpec, l2: L2Sizing = workload_l2,
                    repeats: int = 1) -> tuple[RetractRun, RetractRun]:
    """(L2 on, L2 off) on the same requests, alternating `repeats` times; each one's fastest run."""
    runs: tuple[list[RetractRun], list[RetractRun]] = ([], [])
    for _ in range(repeats):
        for config, done in zip(_on_off_configs(base, retract_pages(spec, base.page_size), l2), runs):
            with _engine(factory, config) as (engine, counter):
                done.append(run_retract(engine, counter, spec))
            log.info("retract-heavy: L2 %s took %.1f s", "on" if done is runs[0] else "off", done[-1].elapsed_s)
    on, off = (min(r, key=lambda run: run.elapsed_s) for r in runs)
    return on, off


# ---- 3. L3 after restart --------------------------------------------------------------------------
def l3_pages(spec: L3Spec, page_size: int) -> tuple[int, int]:
    """(L1, L2) pages: L1 holds one prompt and its first token; L2 every prompt with a quarter spare (the
    writer keeps each until L3 has it, the restarted engine lands its prefetches there); + scratch pages."""
    one = _ceil_pages(spec.prompt_tokens + 1, page_size)
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
    _settle(engine)
    if not engine.host_cache.l3.flush(L3_FLUSH_TIMEOUT_S):
        raise RuntimeError(f"L3 writes not sent after {L3_FLUSH_TIMEOUT_S} s: is Redis answering?")
    return engine.tier_stats()


def _first_token(engine: EngineCore, counter: _CountingRunner, prompt: list[int]) -> tuple[Request, float, int, int]:
    """(the request, its TTFT, tokens an L3 prefetch brought it, its forward tokens), run alone."""
    l3_hits, forward = engine.host_cache.counters.l3_hit_tokens, counter.num_tokens
    req, ttft_s = _run_one(engine, counter, prompt, FIRST_TOKEN)
    _settle(engine)
    return req, ttft_s, engine.host_cache.counters.l3_hit_tokens - l3_hits, counter.num_tokens - forward


def _restarted_prompt(cold: tuple[EngineCore, _CountingRunner], with_l3: tuple[EngineCore, _CountingRunner],
                      prompt: list[int]) -> RestartResult:
    c_req, c_ttft_s, _, _ = _first_token(*cold, prompt)
    req, ttft_s, l3_hits, computed = _first_token(*with_l3, prompt)
    return RestartResult(len(prompt), c_ttft_s, ttft_s, c_req.output_token_ids[0], req.output_token_ids[0],
                         c_req.cached_tokens, req.cached_tokens, l3_hits, computed)


def compare_l3(factory: EngineFactory, base: EngineConfig, spec: L3Spec, url: str,
               l2: L2Sizing = workload_l2) -> L3Run:
    """Prefill the prompts on an engine with L3 at `url` and close it; then run each prompt on two fresh
    engines, cold (no L3) and then with L3."""
    with_l3, cold = _on_off_configs(base, l3_pages(spec, base.page_size), l2)
    with_l3, l3 = dataclasses.replace(with_l3, write_policy="write_through"), bench_l3_config(url)
    with _engine(factory, with_l3, l3) as (writer, counter):
        prompts = l3_prompts(spec, writer.arch.vocab_size)
        before = _l3_flushed(writer)
        for prompt in prompts:
            _first_token(writer, counter, prompt)
        written = L3Traffic.between(before, _l3_flushed(writer))
    log.info("L3 after restart: %d pages written, restarting", written.put_pages)
    with _engine(factory, cold) as off, _engine(factory, with_l3, l3) as on:
        before, results = _l3_flushed(on[0]), []
        for prompt in prompts:
            results.append(_restarted_prompt(off, on, prompt))
            log.info("L3 after restart: prompt %d/%d, TTFT cold %.2f s, from L3 %.2f s", len(results), len(prompts),
                     results[-1].ttft_cold_s, results[-1].ttft_l3_s)
        read = L3Traffic.between(before, _l3_flushed(on[0]))
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


# ---- the command ----------------------------------------------------------------------------------
QUICK = dict(conversations=3, turns=4, turn_input_len=112, turn_output_len=8, requests=6, prompt_len=64,
             output_len=64, l3_prompts=2, l3_prompt_len=192)
L3_SIZES = dict(l3_prompts=2, l3_prompt_len=1500)
"""The L3 phase's sizes where the parser leaves them None (or has no such flag)."""


def specs_from_args(args: argparse.Namespace) -> tuple[MultiTurnSpec, RetractSpec, L3Spec]:
    given = {k: v for k, v in vars(args).items() if v is not None}
    sizes = {**L3_SIZES, **given, **(QUICK if args.quick else {})}
    if min(sizes[k] for k in QUICK) < 1 or args.repeats < 1 or not (args.l1_conversations > 0 and args.l1_fraction > 0):
        raise ValueError("workload sizes and --repeats must be >= 1, --l1-conversations and --l1-fraction > 0")
    return (MultiTurnSpec(sizes["conversations"], sizes["turns"], sizes["turn_input_len"],
                          sizes["turn_output_len"], args.l1_conversations, args.seed),
            RetractSpec(sizes["requests"], sizes["prompt_len"], sizes["output_len"], args.l1_fraction, args.seed),
            L3Spec(sizes["l3_prompts"], sizes["l3_prompt_len"], args.seed))


def bench_hicache(args: argparse.Namespace, factory: EngineFactory | None = None) -> int:
    """The command: the three phases (or `--only` one); prints and writes `--json`."""
    from cluster.cli.args import engine_config_from_args

    base = engine_config_from_args(args)
    mt_spec, rt_spec, l3_spec = specs_from_args(args)
    factory = factory or shared_model_factory()
    l2 = l2_sizing(args)
    summary: dict = {"config": {"model": base.model, "device": base.device, "dtype": base.dtype,
                                "page_size": base.page_size, "write_policy": base.write_policy}}
    if args.only in (None, "multiturn"):
        log.info("multi-turn: %s", mt_spec)
        on, off = compare_multiturn(factory, base, mt_spec, l2)
        summary["multiturn"] = multiturn_summary(mt_spec, on, off)
        print_multiturn(summary["multiturn"])
    if args.only in (None, "retract"):
        log.info("retract-heavy: %s", rt_spec)
        on, off = compare_retract(factory, base, rt_spec, l2, args.repeats)
        summary["retract"] = retract_summary(rt_spec, on, off)
        print_retract(summary["retract"])
    if args.only in (None, "l3"):
        log.info("L3 after restart: %s", l3_spec)
        summary["l3"] = l3_phase(args, factory, base, l3_spec, l2)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


def l2_sizing(args: argparse.Namespace) -> L2Sizing:
    """L2 of the "on" runs: --host-cache-pages, else --host-cache-ratio x L1, else sized from the workload."""
    if args.host_cache_pages is not None:
        return lambda l1_pages, sized_pages: args.host_cache_pages
    if args.host_cache_ratio is not None:
        return lambda l1_pages, sized_pages: int(l1_pages * args.host_cache_ratio)
    return workload_l2


def multiturn_summary(spec: MultiTurnSpec, on: MultiTurnRun, off: MultiTurnRun) -> dict:
    def run(r: MultiTurnRun) -> dict:
        return {"l1_pages": r.l1_pages, "l2_pages": r.l2_pages, "elapsed_s": r.elapsed_s,
                "ttft_mean_turns2plus_s": r.ttft_mean_later_s,
                "computed_prefill_tokens_turns2plus": r.total("computed_prefill_tokens"),
                "cached_tokens_turns2plus": r.total("cached_tokens"),
                "l2_hit_tokens_turns2plus": r.total("host_hit_tokens"),
                "turns": [asdict(t) for t in r.turns]}

    per_turn = [{"turn": t, "prompt_tokens": _mean([x.prompt_tokens for x in on.turns if x.turn == t]),
                 "ttft_on_s": _mean([x.ttft_s for x in on.turns if x.turn == t]),
                 "ttft_off_s": _mean([x.ttft_s for x in off.turns if x.turn == t]),
                 "l2_hit_tokens_on": sum(x.host_hit_tokens for x in on.turns if x.turn == t)}
                for t in range(1, spec.turns + 1)]
    later_off, later_on = off.ttft_mean_later_s, on.ttft_mean_later_s
    return {"workload": {**asdict(spec), "final_tokens": spec.final_tokens, "schedule": SCHEDULE_NOTE},
            "l2_on": run(on), "l2_off": run(off), "per_turn": per_turn,
            "ttft_ratio_off_over_on": later_off / later_on if later_on else None,
            "outputs_identical": on.outputs == off.outputs}


def retract_summary(spec: RetractSpec, on: RetractRun, off: RetractRun) -> dict:
    def run(r: RetractRun) -> dict:
        return {**{k: v for k, v in asdict(r).items() if k != "outputs"},
                "output_tokens_per_s": r.output_tokens_per_s, "recomputed_tokens": r.recomputed_tokens}

    return {"workload": asdict(spec), "l2_on": run(on), "l2_off": run(off),
            "throughput_ratio_on_over_off": on.output_tokens_per_s / off.output_tokens_per_s,
            "outputs_identical": on.outputs == off.outputs}


def l3_summary(spec: L3Spec, run: L3Run, redis: str) -> dict:
    cold, from_l3 = (_mean([getattr(p, f) for p in run.prompts]) for f in ("ttft_cold_s", "ttft_l3_s"))
    w, r = run.written, run.read
    return {"workload": {**asdict(spec), "l1_pages": run.l1_pages, "l2_pages": run.l2_pages, "redis": redis},
            "prompts": [asdict(p) for p in run.prompts], "ttft_cold_mean_s": cold, "ttft_l3_mean_s": from_l3,
            "ttft_ratio_cold_over_l3": cold / from_l3 if from_l3 else None,
            "l3_hit_tokens": sum(p.l3_hit_tokens for p in run.prompts),
            "writer": {**asdict(w), "put_ms_per_page": 1e3 * w.put_s / w.put_pages if w.put_pages else None},
            "restarted": {**asdict(r), "get_ms_per_page": 1e3 * r.get_s / r.get_pages if r.get_pages else None},
            "first_tokens_identical": all(p.first_token_cold == p.first_token_l3 for p in run.prompts)}


def print_multiturn(s: dict) -> None:
    w, on, off = s["workload"], s["l2_on"], s["l2_off"]
    print(f"\nmulti-turn: {w['conversations']} conversations x {w['turns']} turns, {w['user_tokens']} user + "
          f"{w['output_tokens']} answer tokens per turn (history {w['final_tokens']} at the end); "
          f"L1 {on['l1_pages']} pages, L2 {on['l2_pages']} pages\n  {w['schedule']}")
    print(f"{'turn':>6}{'prompt_tok':>12}{'ttft_on_s':>12}{'ttft_off_s':>12}{'l2_hit_tok':>12}")
    for t in s["per_turn"]:
        print(f"{t['turn']:>6}{t['prompt_tokens']:>12.0f}{t['ttft_on_s']:>12.3f}{t['ttft_off_s']:>12.3f}"
              f"{t['l2_hit_tokens_on']:>12}")
    print(f"{'L2':<6}{'ttft_mean_t2+_s':>17}{'computed_t2+':>14}{'cached_t2+':>12}{'l2_hit_t2+':>12}{'elapsed_s':>11}")
    for name, r in (("on", on), ("off", off)):
        print(f"{name:<6}{r['ttft_mean_turns2plus_s']:>17.3f}{r['computed_prefill_tokens_turns2plus']:>14}"
              f"{r['cached_tokens_turns2plus']:>12}{r['l2_hit_tokens_turns2plus']:>12}{r['elapsed_s']:>11.1f}")
    ratio = s["ttft_ratio_off_over_on"]
    print(f"TTFT ratio off / on (turns >= 2): {ratio:.2f}x" if ratio else "TTFT ratio: no turns >= 2")
    print(f"greedy outputs identical on / off: {'yes' if s['outputs_identical'] else 'NO'}")


def print_retract(s: dict) -> None:
    w, on = s["workload"], s["l2_on"]
    print(f"\nretract-heavy: {w['requests']} requests at once, prompt {w['prompt_tokens']} + output "
          f"{w['output_tokens']} tokens; L1 {on['l1_pages']} pages, L2 {on['l2_pages']} pages")
    print(f"{'L2':<6}{'elapsed_s':>11}{'output_tok/s':>14}{'retractions':>13}{'recomputed_tok':>16}{'l2_hit_tok':>12}")
    for name in ("on", "off"):
        r = s[f"l2_{name}"]
        print(f"{name:<6}{r['elapsed_s']:>11.2f}{r['output_tokens_per_s']:>14.1f}{r['retractions']:>13}"
              f"{r['recomputed_tokens']:>16}{r['l2_hit_tokens']:>12}")
    print(f"throughput ratio on / off: {s['throughput_ratio_on_over_off']:.2f}x")
    print(f"greedy outputs identical on / off: {'yes' if s['outputs_identical'] else 'NO'}")


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


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0
