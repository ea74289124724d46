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
3. L3 after restart (`cluster.bench.hicache_l3`). An engine with L3 (Redis) prefills N prompts of P seeded random
   tokens, waits until L3 has their pages, and is closed. Then two engines start empty, as after restarting every
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

The engines, their forward counter and the timing of a request run alone are hicache_engines.py's,
shared with the L3 phase. Every engine ends with its backups drained and `engine.check_integrity()`.
A run whose engine stops making progress (`STALL_STEPS`) raises instead of spinning.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass
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
    shared_model_factory,
    steps_until_finished,
    warm_engine,
    workload_l2,
)
from cluster.bench.hicache_l3 import L3Spec, l3_phase
from common.config import EngineConfig, SamplingParams

if TYPE_CHECKING:
    from engine import EngineCore

log = logging.getLogger("tandem.bench")

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
        return mean_or_zero([t.ttft_s for t in self.later()])

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


# ---- 1. multi-turn --------------------------------------------------------------------------------
def multiturn_pages(spec: MultiTurnSpec, page_size: int) -> tuple[int, int]:
    """(L1, L2) pages: L1 holds `l1_conversations` final histories (at least one whole request) + the
    scratch page; L2 holds every conversation's (a quarter spare for partial pages) + its scratch page."""
    final = spec.final_tokens
    l1 = max(ceil_pages(spec.l1_conversations * final, page_size), ceil_pages(final, page_size)) + 1
    return l1, ceil_pages(1.25 * spec.conversations * final, page_size) + 1


def user_turns(spec: MultiTurnSpec, vocab_size: int) -> list[list[list[int]]]:
    rng = random.Random(spec.seed)
    return [[[rng.randrange(10, vocab_size) for _ in range(spec.user_tokens)] for _ in range(spec.turns)]
            for _ in range(spec.conversations)]


class _Conversations:
    """One engine's side of the multi-turn workload: its histories and results so far."""

    def __init__(self, engine: EngineCore, counter: ForwardCounter, spec: MultiTurnSpec):
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
        req, ttft_s = run_one(self.engine, self.counter, prompt, self.params)
        self.elapsed_s += time.perf_counter() - start_s
        computed = self.counter.num_tokens - before - (len(req.output_token_ids) - 1)
        self.turns.append(TurnResult(c, len(self.outputs[c]) + 1, len(prompt), req.cached_tokens,
                                     req.tier.host_hit_tokens, computed, ttft_s))
        self.outputs[c].append(req.output_token_ids)
        self.histories[c] = prompt + req.output_token_ids
        settle(self.engine)

    def result(self) -> MultiTurnRun:
        return MultiTurnRun(*resolved_pages(self.engine.config), self.turns, self.outputs, self.elapsed_s)


def resolved_pages(config: EngineConfig) -> tuple[int, int]:
    """(L2, L1) pages of an engine's config, which `EngineConfig.resolve` has set."""
    assert config.host_cache_pages is not None and config.num_pages is not None, "the config was not resolved"
    return config.host_cache_pages, config.num_pages


def compare_multiturn(factory: EngineFactory, base: EngineConfig, spec: MultiTurnSpec,
                      l2: L2Sizing = workload_l2) -> tuple[MultiTurnRun, MultiTurnRun]:
    """(L2 on, L2 off) on the same conversations, request by request alternating between the two."""
    configs = on_off_configs(base, multiturn_pages(spec, base.page_size), l2)
    with contextlib.ExitStack() as stack:
        sides = [_Conversations(*stack.enter_context(warm_engine(factory, config)), spec) for config in configs]
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
    one = ceil_pages(spec.prompt_tokens + spec.output_tokens, page_size)
    l1 = max(math.ceil(spec.l1_fraction * spec.requests * one), one) + 1
    return l1, math.ceil(1.25 * spec.requests * one) + 1


def retract_prompts(spec: RetractSpec, vocab_size: int) -> list[list[int]]:
    rng = random.Random(spec.seed)
    return [[rng.randrange(10, vocab_size) for _ in range(spec.prompt_tokens)] for _ in range(spec.requests)]


def run_retract(engine: EngineCore, counter: ForwardCounter, spec: RetractSpec) -> RetractRun:
    prompts = retract_prompts(spec, engine.arch.vocab_size)
    retractions, hits = engine.num_retractions, engine.tier_stats().hit_tokens_l2
    start_s = time.perf_counter()
    params = SamplingParams(max_tokens=spec.output_tokens, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in prompts]
    for _ in steps_until_finished(engine, counter, reqs):
        pass
    elapsed_s = time.perf_counter() - start_s
    outputs = [r.output_token_ids for r in reqs]
    if any(len(o) != spec.output_tokens for o in outputs):
        raise RuntimeError(f"asked for {spec.output_tokens} tokens each, got {sorted(map(len, outputs))}: aborted?")
    return RetractRun(*resolved_pages(engine.config), elapsed_s, sum(map(len, outputs)),
                      counter.num_tokens, sum(len(p) + spec.output_tokens - 1 for p in prompts),
                      engine.num_retractions - retractions, engine.tier_stats().hit_tokens_l2 - hits, outputs)


def compare_retract(factory: EngineFactory, base: EngineConfig, spec: RetractSpec, l2: L2Sizing = workload_l2,
                    repeats: int = 1) -> tuple[RetractRun, RetractRun]:
    """(L2 on, L2 off) on the same requests, alternating `repeats` times; each one's fastest run."""
    runs: tuple[list[RetractRun], list[RetractRun]] = ([], [])
    for _ in range(repeats):
        for config, done in zip(on_off_configs(base, retract_pages(spec, base.page_size), l2), runs):
            with warm_engine(factory, config) as (engine, counter):
                done.append(run_retract(engine, counter, spec))
            log.info("retract-heavy: L2 %s took %.1f s", "on" if done is runs[0] else "off", done[-1].elapsed_s)
    on, off = (min(r, key=lambda run: run.elapsed_s) for r in runs)
    return on, off


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
        rt_on, rt_off = compare_retract(factory, base, rt_spec, l2, args.repeats)
        summary["retract"] = retract_summary(rt_spec, rt_on, rt_off)
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

    per_turn = [{"turn": t, "prompt_tokens": mean_or_zero([x.prompt_tokens for x in on.turns if x.turn == t]),
                 "ttft_on_s": mean_or_zero([x.ttft_s for x in on.turns if x.turn == t]),
                 "ttft_off_s": mean_or_zero([x.ttft_s for x in off.turns if x.turn == t]),
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
