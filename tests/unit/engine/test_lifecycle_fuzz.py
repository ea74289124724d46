"""Randomized request lifecycles on the tiny Llama with KV integrity checked after every step.

Random lengths, shared prefixes, staggered arrivals, aborts at random steps, pools small enough to
force retraction, page sizes 1/4/16. Greedy requests that run to the end must produce exactly
what the same prompt produces alone in a roomy pool.
"""

import functools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.config import SamplingParams
from engine.request import FinishReason
from tests.helpers import assert_pool_at_rest, make_engine

NUM_EXAMPLES = 60
MIN_REQUESTS = 5
lifecycles = {"count": 0, "retractions": 0, "aborts": 0, "cached": 0}

BASES = [[(7 * i + 3 * b) % 250 + 3 for i in range(48)] for b in range(2)]

request_spec = st.fixed_dictionaries({
    "base": st.sampled_from([None, 0, 1]),
    "shared_len": st.integers(1, 48),
    "suffix": st.lists(st.integers(3, 255), min_size=1, max_size=24),
    "max_tokens": st.integers(1, 24),
    "arrive_at": st.integers(0, 6),
    "abort_at": st.one_of(st.none(), st.integers(0, 12)),
    "temperature": st.sampled_from([0.0, 0.0, 0.8]),
    "seed": st.integers(0, 2**31),
})


def prompt_of(spec) -> list[int]:
    prefix = BASES[spec["base"]][:spec["shared_len"]] if spec["base"] is not None else []
    return prefix + spec["suffix"]


@functools.cache
def solo_output(prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    engine = make_engine(page_size=4, num_pages=256, enable_prefix_cache=False)
    return engine.generate([list(prompt)], SamplingParams(max_tokens=max_tokens))[0].output_token_ids


@settings(max_examples=NUM_EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(page_size=st.sampled_from([1, 4, 16]), pool_tokens=st.sampled_from([80, 96, 128, 512]),
       chunk_size=st.sampled_from([4, 16, 64]), cache=st.booleans(),
       specs=st.lists(request_spec, min_size=MIN_REQUESTS, max_size=9))
def test_random_lifecycles_keep_kv_consistent(page_size, pool_tokens, chunk_size, cache, specs):
    engine = make_engine(page_size=page_size, num_pages=1 + pool_tokens // page_size, chunk_size=chunk_size,
                         max_running_requests=6, enable_prefix_cache=cache)  # debug_kv: integrity every step
    pending = sorted(enumerate(specs), key=lambda s: s[1]["arrive_at"])
    live, step = {}, 0
    while pending or engine.busy():
        while pending and pending[0][1]["arrive_at"] <= step:
            i, spec = pending.pop(0)
            params = SamplingParams(max_tokens=spec["max_tokens"], temperature=spec["temperature"], seed=spec["seed"])
            live[i] = engine.add_request(prompt_of(spec), params)
        for i, req in live.items():
            if specs[i]["abort_at"] == step - specs[i]["arrive_at"]:
                engine.abort(req.request_id)
        engine.step()
        step += 1
        assert step < 2000, "engine made no progress: livelock between retract and admit?"
    for i, req in live.items():
        spec = specs[i]
        assert req.finish_reason is not None
        if req.finish_reason is not FinishReason.ABORT:
            expect_len = min(spec["max_tokens"], pool_tokens - len(req.prompt_token_ids))  # the pool caps a request
            assert len(req.output_token_ids) == expect_len
            if spec["temperature"] == 0:
                assert req.output_token_ids == solo_output(tuple(req.prompt_token_ids), expect_len)
    assert_pool_at_rest(engine)
    lifecycles["count"] += len(specs)
    lifecycles["retractions"] += engine.num_retractions
    lifecycles["aborts"] += sum(r.finish_reason is FinishReason.ABORT for r in live.values())
    lifecycles["cached"] += sum(r.cached_tokens > 0 for r in live.values())


def test_fuzz_covered_enough_lifecycles():
    """Runs after the fuzz test (file order): the randomized runs exercised every path."""
    assert lifecycles["count"] >= 300, lifecycles
    assert lifecycles["retractions"] > 0 and lifecycles["aborts"] > 0 and lifecycles["cached"] > 0, lifecycles
