"""The age boost of the prefill budget (`engine/scheduler.py`): a prompt that has waited
`prefill_age_boost_s` since its engine received it adds a chunk to every step's budget per such wait,
up to `MAX_BUDGET_CHUNKS`; so an aged prompt behind decoding streams takes fewer, larger steps, and
its tokens are still transformers' own."""

from __future__ import annotations

import time

import pytest

from common.config import ConfigError, EngineConfig
from engine.request import RequestStatus
from engine.scheduler import MAX_BUDGET_CHUNKS
from tests.helpers import assert_pool_at_rest, greedy, hf_greedy, make_engine, make_prompts, tiny_models

CHUNK = 8


def _age(req, seconds: float) -> None:
    req.timings["received"] = time.monotonic() - seconds


def test_the_budget_grows_a_chunk_per_wait_up_to_the_cap():
    engine = make_engine(chunk_size=CHUNK, prefill_age_boost_s=1.0)
    scheduler, now = engine.scheduler, time.monotonic()
    assert scheduler.prefill_budget(now) == CHUNK  # nothing waits
    req = engine.add_request(make_prompts(1, min_len=30, max_len=30)[0], greedy(max_tokens=4))
    for waited, chunks in ((0.0, 1), (0.99, 1), (1.0, 2), (2.5, 3), (60.0, MAX_BUDGET_CHUNKS)):  # per 1 s
        _age(req, waited)
        assert scheduler.prefill_budget(time.monotonic()) == chunks * CHUNK, waited
    off = make_engine(chunk_size=CHUNK, prefill_age_boost_s=0)
    _age(off.add_request([5, 6, 7], greedy(max_tokens=2)), 60.0)
    assert off.scheduler.prefill_budget(time.monotonic()) == CHUNK
    with pytest.raises(ConfigError, match="prefill_age_boost_s must be a number >= 0"):
        EngineConfig(prefill_age_boost_s=-1)


def test_an_aged_prompt_behind_decoding_streams_takes_larger_steps_and_hfs_tokens():
    prompts = make_prompts(3, min_len=40, max_len=40, seed=4)
    _, ref, _ = tiny_models()
    rows = {}
    for boost_s in (0, 1.0):
        engine = make_engine(chunk_size=CHUNK, prefill_age_boost_s=boost_s)
        decoding = [engine.add_request(p, greedy(max_tokens=30)) for p in prompts[:2]]
        while any(r.status is RequestStatus.WAITING or r.num_uncomputed > 1 for r in decoding):
            engine.step()
        for r in decoding:
            _age(r, 0.0)  # their own wait is over; only the new prompt's counts
        late = engine.add_request(prompts[2], greedy(max_tokens=6))
        _age(late, 3.5)  # waited 3.5 s: 4 chunks a step with the boost
        steps = 0
        while late.status is RequestStatus.WAITING or late.num_uncomputed > 1:
            engine.step()
            steps += 1
        rows[boost_s] = steps
        while engine.busy():
            engine.step()
        assert late.output_token_ids == hf_greedy(ref, prompts[2], 6)
        assert_pool_at_rest(engine)
    assert rows == {0: 40 // CHUNK, 1.0: 40 // (MAX_BUDGET_CHUNKS * CHUNK) + 1}
