"""Sampling parameters at their edges: values that cannot be represented are rejected or clamped,
and none of them can break the sampler for the other requests of its batch."""

import math

import pytest
import torch

from common.config import (
    GREEDY_TEMPERATURE_BELOW,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    ConfigError,
    SamplingParams,
)
from kernels.sampling import sample
from tests.helpers import assert_pool_at_rest, greedy, make_engine, make_prompts


def test_top_k_of_2_pow_63_is_off_and_its_batch_is_unharmed():
    prompts = make_prompts(4, seed=11)
    huge = SamplingParams(max_tokens=12, temperature=0.9, top_k=2**63, seed=5)
    off = SamplingParams(max_tokens=12, temperature=0.9, top_k=0, seed=5)
    engine = make_engine()
    out = engine.generate(prompts, [greedy(max_tokens=12), huge, greedy(max_tokens=12), off])
    alone = make_engine().generate([prompts[0], prompts[2]], greedy(max_tokens=12))
    assert [out[0].output_token_ids, out[2].output_token_ids] == [r.output_token_ids for r in alone]
    assert out[1].output_token_ids == make_engine().generate([prompts[1]], off)[0].output_token_ids
    assert_pool_at_rest(engine)


def test_top_k_at_or_past_the_vocabulary_keeps_every_token():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))

    def draw(top_k: int) -> list[int]:
        return sample(logits, [1.0] * 3, [top_k] * 3, [1.0] * 3, seeds=[7, 8, 9], steps=[0, 1, 2]).tolist()

    assert draw(50) == draw(51) == draw(10**30) == draw(0)


def test_tiny_temperature_is_greedy():
    # 1e-45 is a float32 subnormal: logits / 1e-45 overflow to inf and the softmax to NaN
    assert SamplingParams(temperature=1e-45).greedy and SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE_BELOW).greedy
    logits = torch.randn(4, 256, generator=torch.Generator().manual_seed(1)) * 20
    tiny = sample(logits, [1e-45, 1e-30, 1e-6, 0.0], [0] * 4, [1.0] * 4, [3] * 4, [0] * 4)
    assert tiny.tolist() == logits.argmax(dim=-1).tolist()
    prompts = make_prompts(3, seed=4)
    engine = make_engine()
    out = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=1e-45, seed=9))
    reference = make_engine().generate(prompts, greedy(max_tokens=16))
    assert [r.output_token_ids for r in out] == [r.output_token_ids for r in reference]
    assert_pool_at_rest(engine)


@pytest.mark.parametrize("bad, match", [
    (dict(temperature=math.nan), "temperature must be a finite number"),
    (dict(temperature=math.inf), "temperature must be a finite number"),
    (dict(temperature="1"), "temperature must be a finite number"),
    (dict(top_p=math.nan), r"top_p must be in \(0, 1\]"),
    (dict(top_p=math.inf), r"top_p must be in \(0, 1\]"),
    (dict(top_k=True), "top_k must be an integer"),
    (dict(top_k=2.5), "top_k must be an integer"),
    (dict(seed=2**63), r"seed must be an integer in \[-2\^63, 2\^63\)"),
    (dict(seed=-2**63 - 1), r"seed must be an integer in \[-2\^63, 2\^63\)"),
    (dict(seed=1.5), "seed must be an integer"),
    (dict(max_tokens=True), "max_tokens must be an integer"),
    (dict(stop=("a", "")), "stop strings must be non-empty"),
    (dict(stop=7), "stop and stop_token_ids must be sequences"),
    (dict(stop=tuple(f"s{i}" for i in range(MAX_STOP_STRINGS + 1))), f"at most {MAX_STOP_STRINGS} stop strings"),
    (dict(stop=("x" * (MAX_STOP_CHARS // 2), "y" * (MAX_STOP_CHARS // 2 + 1))),
     f"{MAX_STOP_CHARS} characters together at most, got {MAX_STOP_CHARS + 1}"),
    (dict(stop_token_ids=tuple(range(MAX_STOP_TOKEN_IDS + 1))), f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids"),
    (dict(stop_token_ids=(3, -1)), "stop_token_ids must be non-negative integers"),
])
def test_unrepresentable_values_are_rejected_with_a_clear_error(bad, match):
    with pytest.raises(ConfigError, match=match):
        SamplingParams(**bad)


def test_values_at_the_bounds_are_accepted():
    SamplingParams(seed=2**63 - 1, top_k=2**80, temperature=1e308, top_p=1.0,
                   stop=tuple("x" * (MAX_STOP_CHARS // MAX_STOP_STRINGS) for _ in range(MAX_STOP_STRINGS)),
                   stop_token_ids=tuple(range(MAX_STOP_TOKEN_IDS)))
    SamplingParams(seed=-2**63)
