"""Whether drafting pays, measured while serving (engine/spec/policy.py): the policy
on a scripted clock, then an engine whose verify steps a clock makes slow or fast. Output is HF's
either way; only whether steps carry drafts changes."""

from __future__ import annotations

import pytest

from engine.spec.policy import AdaptivePolicy, _bucket
from tests.helpers import assert_pool_at_rest, greedy, hf_greedy, make_prompts, make_spec_engine, tiny_models


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _run_steps(policy: AdaptivePolicy, clock: Clock, batch: int, steps: int, spec_s: float, plain_s: float,
               spec_tokens: int) -> list[bool]:
    """`steps` decode steps of `batch` rows: a drafted step takes `spec_s` and emits `spec_tokens` a
    row, a plain one `plain_s` and one a row. Returns the decisions."""
    decisions, drafted = [], policy.want_drafts(batch)
    for _ in range(steps):
        policy.begin_step()
        clock.now += spec_s if drafted else plain_s
        policy.end_step(batch, batch * (spec_tokens if drafted else 1), verified=drafted)
        decisions.append(drafted)
        drafted = policy.want_drafts(batch)
    return decisions


def test_buckets_are_powers_of_two():
    assert [_bucket(b) for b in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, 16]


@pytest.mark.parametrize("spec_s,expect_drafting", [(2.0, False), (1.0, True)])
def test_explores_both_modes_then_keeps_the_faster(spec_s, expect_drafting):
    clock = Clock()
    policy = AdaptivePolicy(warmup=4, probe_every=50, clock=clock)
    # drafted steps emit 1.5 tokens a row: at 2x the cost of a plain step they lose, at 1x they win
    decisions = _run_steps(policy, clock, batch=2, steps=100, spec_s=spec_s, plain_s=1.0, spec_tokens=1.5)
    assert decisions[:4] == [True] * 4 and decisions[4:8] == [False] * 4  # explore: drafts, then plain
    settled = decisions[8:]
    kept = sum(d == expect_drafting for d in settled)
    assert kept >= len(settled) - 2 * 2, settled  # all but the re-probes (warmup // 2 steps each 50)
    assert kept < len(settled), "never re-probed the other mode"
    rates = policy.summary()[2]
    assert (rates["eagle"] >= rates["plain"]) == expect_drafting


def test_buckets_are_measured_apart():
    clock = Clock()
    policy = AdaptivePolicy(warmup=2, probe_every=1000, clock=clock)
    slow = _run_steps(policy, clock, batch=8, steps=20, spec_s=3.0, plain_s=1.0, spec_tokens=2)
    fast = _run_steps(policy, clock, batch=1, steps=20, spec_s=1.0, plain_s=1.0, spec_tokens=2)
    assert not any(slow[4:]) and all(fast[4:])


def test_steps_with_prefill_or_no_rows_are_not_counted():
    clock = Clock()
    policy = AdaptivePolicy(warmup=1, clock=clock)
    policy.begin_step()
    clock.now += 1
    policy.end_step(0, 0, verified=True)
    policy.end_step(1, 1, verified=True)  # no begin_step: nothing to time
    assert policy.summary() == {}


@pytest.mark.parametrize("accept,slow_verify,expect_drafting", [(0.0, True, False), (1.0, False, True)])
def test_an_engine_stops_drafting_where_it_does_not_pay(accept, slow_verify, expect_drafting):
    """Scripted drafts (every one wrong, or every one right); a clock under which a step that
    verified takes 3x (slow) or as long as (fast) a plain step. Wrong drafts at 3x cost: the engine
    stops drafting after exploring; right drafts at no cost: it keeps drafting."""
    from tests.unit.engine.test_spec_engine import _script_drafts

    _, ref, _ = tiny_models()
    prompts = make_prompts(2, min_len=5, max_len=12, seed=8)
    reference = {tuple(p): hf_greedy(ref, p, 60) for p in prompts}
    engine = make_spec_engine(speculative_adaptive=True, max_running_requests=2)
    clock = Clock()
    engine.speculator.policy = AdaptivePolicy(warmup=3, probe_every=1000, clock=clock)
    _script_drafts(engine, reference, accept=accept)
    counters = engine.speculator.counters
    verify = engine.speculator.verify

    def timed_verify(req, logits):
        clock.now += 1.0 if slow_verify else 0.0  # per request: a step of 2 verify rows costs 2 more
        return verify(req, logits)
    engine.speculator.verify = timed_verify
    begin = engine.speculator.begin_step

    def tick():
        clock.now += 1.0  # every step's own cost
        begin()
    engine.speculator.begin_step = tick
    verifies_per_step = []
    reqs = [engine.add_request(p, greedy(max_tokens=60)) for p in prompts]
    while any(r.finish_reason is None for r in reqs):
        before = counters.verifies
        engine.step()
        verifies_per_step.append(counters.verifies - before)
    assert [r.output_token_ids for r in reqs] == [reference[tuple(p)] for p in prompts]
    late = verifies_per_step[12:]  # past exploring (3 drafted + 3 plain steps) and the prefill
    assert late and (sum(late) > 0) == expect_drafting, verifies_per_step
    if expect_drafting:
        assert counters.mean_accepted_length > 3
    assert_pool_at_rest(engine)
