"""`tandem bench decode --speculative eagle`: EAGLE speculation vs plain decoding, same engine, same run.

For each batch size B and each repeat, a plain engine and a speculative one (alternating which goes
first, so drift in machine load hits both alike) generate greedily for the same held-out chat
prompts (`tandem train-eagle`'s eval split: never trained on), B requests at a time until every
prompt is done. A system's figure is end-to-end output tokens / wall seconds (prefill included).
Both must give the same tokens for every prompt (greedy verification is lossless): a mismatch is
reported and fails the command. The speculative engine's counters give the mean accepted length
(tokens per verify: accepted drafts + the target's own) and the acceptance rate per draft position.

    per batch size:  | plain | eagle | eagle | plain | ...  (--repeats rounds, alternating)

The speculative engine drafts at every step (`speculative_adaptive` off: the mode timed alone).
`--adaptive` times a third engine per round with the measured policy on (`engine/spec/policy.py`:
it drafts only where drafting measured faster), reported as its speed-up over plain. With
`--speculative-topk W` > 1 the eagle engine drafts trees, and a chain engine (W = 1, same depth) is
timed in the same rounds too, so tree and chain compare on the same machine state.

With `--load-back`, it measures instead what a host-tier load-back does to acceptance: per prompt a
first turn, then a second turn (the first turn's tokens + a follow-up) twice, on a fresh speculative
engine each: once with the first turn's KV still on device, once after evicting it to the host tier
(L2), so the second turn's prefix (draft KV included) comes back by load-back. The mean accepted
lengths of the second turns are compared (the issue's bar: within 10%).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cluster.bench import collect_engines
from cluster.bench.decode import sync_device
from common.config import EngineConfig, SamplingParams
from common.protocol import SpecStats
from kernels.kv_layout import TORCH_DTYPES

if TYPE_CHECKING:
    from engine.request import Request

DEFAULT_SPEC_BATCH_SIZES = (1, 16)


@dataclass(frozen=True)
class SpecRun:
    mode: str  # "plain" | "eagle" | "chain" (eagle with topk 1, beside a tree) | "adaptive" (eagle, where it pays)
    batch: int
    wall_s: float
    tokens: tuple[tuple[int, ...], ...]  # per prompt
    verifies: int = 0
    accepted_per_verify: tuple[tuple[int, int], ...] = ()
    accepted_at: tuple[tuple[int, int], ...] = ()
    drafted_at: tuple[tuple[int, int], ...] = ()

    @property
    def tok_per_s(self) -> float:
        return sum(map(len, self.tokens)) / self.wall_s


def run_engine(engine, prompts: list[list[int]], params: SamplingParams, batch: int) -> tuple[float, list[tuple]]:
    """Generate for `prompts`, `batch` running at a time (a new one as each ends); (wall s, tokens)."""
    queue, done = list(enumerate(prompts)), {}
    running: dict[int, Request] = {}
    start_s = time.perf_counter()
    while queue or running:
        while queue and len(running) < batch:
            i, prompt = queue.pop(0)
            running[i] = engine.add_request(prompt, params)
        engine.step()
        for i in [i for i, r in running.items() if r.finish_reason is not None]:
            done[i] = tuple(running.pop(i).output_token_ids)
    sync_device(engine.device)
    return time.perf_counter() - start_s, [done[i] for i in range(len(prompts))]


WARMUP_PROMPT = list(range(100, 132))
"""An untimed request before each timed run (shares no prefix with a chat prompt): on CUDA the first
steps of a process compile Triton kernels, which would otherwise land in whichever run goes first."""


def measure(make_engine, prompts: list[list[int]], params: SamplingParams, batch: int, mode: str) -> SpecRun:
    engine = make_engine(mode, batch)
    run_engine(engine, [WARMUP_PROMPT], dataclasses.replace(params, max_tokens=16, ignore_eos=True), 1)
    warm = engine.spec_stats()  # acceptance of the timed run only
    wall_s, tokens = run_engine(engine, prompts, params, batch)
    engine.check_integrity()
    s = counted_since(warm, engine.spec_stats())
    engine.close()
    return SpecRun(mode, batch, wall_s, tuple(tokens), s.verifies, s.accepted_per_verify, s.accepted_at, s.drafted_at)


def counted_since(before: SpecStats, after: SpecStats) -> SpecStats:
    """What `after` counted since `before` (two `spec_stats()` of one engine), as counters reset at
    `before` would read: a position drafted since has its accepted count there, 0 too (`SpecCounters`)."""
    def grown(old: tuple[tuple[int, int], ...], new: tuple[tuple[int, int], ...]) -> dict[int, int]:
        was = dict(old)
        return {key: n - was.get(key, 0) for key, n in new if n > was.get(key, 0)}

    drafted, accepted = grown(before.drafted_at, after.drafted_at), dict(after.accepted_at)
    accepted_at = tuple((pos, accepted[pos] - dict(before.accepted_at).get(pos, 0)) for pos in sorted(drafted))
    return SpecStats(after.verifies - before.verifies, tuple(sorted(grown(before.accepted_per_verify,
                                                                            after.accepted_per_verify).items())),
                     tuple(sorted(drafted.items())), accepted_at, after.draft_errors - before.draft_errors)


FOLLOW_UP = "\nPlease go on, with an example."


def measure_load_back(make_engine, prompts: list[list[int]], follow_up: list[int], params: SamplingParams) -> dict:
    """Mean accepted length of second turns whose first turn stayed on device vs was loaded back."""
    result: dict[str, Any] = {}  # the JSON of the run
    for evict in (False, True):
        accepted, verifies, loaded_tokens = 0, 0, 0
        for prompt in prompts:
            engine = make_engine("eagle", 1)
            [first] = engine.generate([prompt], params)
            while engine.busy():  # host-tier backups of the first turn
                engine.step()
            if evict:
                engine.evict_device_cache()
            before = engine.spec_stats()
            [second] = engine.generate([prompt + first.output_token_ids + follow_up], params)
            after = engine.spec_stats()
            accepted += sum(a * n for a, n in after.accepted_per_verify) - sum(
                a * n for a, n in before.accepted_per_verify)
            verifies += after.verifies - before.verifies
            loaded_tokens += second.tier.host_hit_tokens
            engine.check_integrity()
            engine.close()
        result["loaded_back" if evict else "on_device"] = {
            "mean_accepted_length": 1 + accepted / verifies if verifies else 0.0, "verifies": verifies,
            "host_hit_tokens": loaded_tokens}
    on, off = result["on_device"]["mean_accepted_length"], result["loaded_back"]["mean_accepted_length"]
    result["ratio"] = off / on if on else 0.0
    return result


def summarize(runs: list[SpecRun], config: EngineConfig) -> dict:
    by_batch: dict[int, dict] = {}
    for batch in sorted({r.batch for r in runs}):
        plain = [r for r in runs if r.batch == batch and r.mode == "plain"]
        eagle = [r for r in runs if r.batch == batch and r.mode == "eagle"]
        plain_tps = statistics.median(r.tok_per_s for r in plain)
        by_batch[batch] = {
            "plain_tok_per_s": plain_tps, "plain_tok_per_s_all": [r.tok_per_s for r in plain],
            "eagle_tok_per_s_all": [r.tok_per_s for r in eagle], **_speculative("eagle", eagle, plain_tps, ""),
            "identical_outputs": all(r.tokens == plain[0].tokens for r in runs if r.batch == batch),
            "output_tokens": sum(map(len, plain[0].tokens)),
        }
        by_batch[batch]["speedup"] = by_batch[batch].pop("eagle_speedup")
        for mode in ("chain", "adaptive"):
            others = [r for r in runs if r.batch == batch and r.mode == mode]
            if others:
                by_batch[batch] |= _speculative(mode, others, plain_tps, f"{mode}_")
    return {"model": config.model, "device": config.device, "dtype": config.dtype, "draft_model": config.draft_model,
            "num_draft_tokens": config.num_draft_tokens, "speculative_topk": config.speculative_topk,
            "speculative_tree_nodes": config.speculative_tree_nodes, "batches": by_batch}


def mode_config(config: EngineConfig, mode: str, batch: int) -> EngineConfig:
    """`config` for one timed system: `plain` (no speculation), `eagle` (as configured, always
    drafting), `chain` (the same depth, one node per level) or `adaptive`, at most `batch` running."""
    tree = mode != "chain"
    return dataclasses.replace(config, max_running_requests=batch, speculative="none" if mode == "plain" else "eagle",
                               speculative_adaptive=mode == "adaptive",
                               speculative_topk=config.speculative_topk if tree else 1,
                               speculative_tree_nodes=config.speculative_tree_nodes if tree else 0)


def _speculative(mode: str, runs: list[SpecRun], plain_tps: float, prefix: str) -> dict:
    """Speed and acceptance of one speculative mode's runs (keys prefixed, but `<mode>_tok_per_s`)."""
    verifies = sum(r.verifies for r in runs)
    accepted = sum(a * n for r in runs for a, n in r.accepted_per_verify)
    drafted, taken = _sum_pairs(r.drafted_at for r in runs), _sum_pairs(r.accepted_at for r in runs)
    tps = statistics.median(r.tok_per_s for r in runs)
    return {f"{mode}_tok_per_s": tps, f"{mode}_speedup": tps / plain_tps, f"{prefix}verifies": verifies,
            f"{prefix}mean_accepted_length": 1 + accepted / verifies if verifies else 0.0,
            f"{prefix}acceptance_rate_per_position": {p: taken.get(p, 0) / n for p, n in sorted(drafted.items())}}


def _sum_pairs(groups) -> dict[int, int]:
    out: dict[int, int] = {}
    for pairs in groups:
        for key, n in pairs:
            out[key] = out.get(key, 0) + n
    return out


def print_summary(s: dict) -> None:
    nodes = s["speculative_tree_nodes"] or s["speculative_topk"] * s["num_draft_tokens"]
    tree = f", trees of {s['speculative_topk']} per level, {nodes} verified" if s["speculative_topk"] > 1 else ""
    print(f"{s['model']} {s['device']} {s['dtype']}, k = {s['num_draft_tokens']}{tree}, head {s['draft_model']}")
    print(f"{'batch':>5} {'plain tok/s':>12} {'eagle tok/s':>12} {'speedup':>8} {'accept len':>10} "
          f"{'per position':>24} {'same tokens':>11}")
    for batch, b in s["batches"].items():
        rates = " ".join(f"{r:.2f}" for r in b["acceptance_rate_per_position"].values())
        print(f"{batch:>5} {b['plain_tok_per_s']:>12.1f} {b['eagle_tok_per_s']:>12.1f} {b['speedup']:>7.2f}x "
              f"{b['mean_accepted_length']:>10.2f} {rates:>24} {str(b['identical_outputs']):>11}")
        if "chain_tok_per_s" in b:
            rates = " ".join(f"{r:.2f}" for r in b["chain_acceptance_rate_per_position"].values())
            print(f"{'':>5} chain (topk 1): {b['chain_tok_per_s']:.1f} tok/s, {b['chain_speedup']:.2f}x plain, "
                  f"accept len {b['chain_mean_accepted_length']:.2f} ({rates})")
        if "adaptive_tok_per_s" in b:
            print(f"{'':>5} adaptive: {b['adaptive_tok_per_s']:.1f} tok/s, {b['adaptive_speedup']:.2f}x plain, "
                  f"{b['adaptive_verifies']} verifies (eagle: {b['verifies']})")


def bench_spec_decode(args: argparse.Namespace) -> int:
    """The command (see the module docstring); nonzero when the systems' tokens differ."""
    from cluster.cli.args import engine_config_from_args
    from cluster.train.data import load_prompts, tokenize
    from engine import build_engine
    from engine.spec.factory import load_draft_head
    from kernels.model.loader import load_model

    config = engine_config_from_args(args)
    loaded = load_model(config.model, device=config.device, dtype=TORCH_DTYPES[config.dtype],
                        backend=config.attention_backend)
    head = load_draft_head(config, loaded.model, loaded.arch)
    prompts = tokenize(loaded.tokenizer, load_prompts("eval", args.num_prompts))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)

    def make_engine(mode: str, batch: int):
        collect_engines()
        run_config = dataclasses.replace(mode_config(config, mode, batch),
                                         host_cache_ratio=2.0 if args.load_back else 0.0)
        return build_engine(run_config, loaded.model, loaded.arch, loaded.tokenizer, loaded.eos_token_ids,
                          draft_head=None if mode == "plain" else head)

    if args.load_back:
        follow_up = loaded.tokenizer.encode(FOLLOW_UP, add_special_tokens=False)
        result = measure_load_back(make_engine, prompts, follow_up, params)
        print(json.dumps(result, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        return 0

    runs = []
    for batch in args.batch_sizes or DEFAULT_SPEC_BATCH_SIZES:
        for repeat in range(args.repeats):
            modes = ("plain", "eagle") + ("chain",) * (config.speculative_topk > 1) + ("adaptive",) * args.adaptive
            for mode in (modes if repeat % 2 == 0 else modes[::-1]):
                runs.append(measure(make_engine, prompts, params, batch, mode))
    summary = summarize(runs, config)
    print_summary(summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0 if all(b["identical_outputs"] for b in summary["batches"].values()) else 1
