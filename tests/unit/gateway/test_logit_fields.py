"""The logit fields of a request body (penalties, logit_bias, min_p, min_tokens, max_completion_tokens,
best_of 1, user) reach `SamplingParams`; a bad value is a 400 naming its param."""

from __future__ import annotations

import pytest

from router.gateway.errors import APIError
from router.gateway.schema import ModelLimits, parse_completion

LIMITS = ModelLimits(served_name="m", max_model_len=64, vocab_size=100, default_max_tokens=16, max_prompt_tokens=None)


def parse(**fields):
    return parse_completion({"prompt": [1, 2, 3], **fields}, tokenizer=None, limits=LIMITS).params


def test_every_field_reaches_the_sampling_params():
    params = parse(presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.2, min_p=0.05, min_tokens=3,
                   logit_bias={"7": 2, "11": -100}, max_tokens=20, max_completion_tokens=9, best_of=1, user="u-1")
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, -1.0, 1.2)
    assert (params.min_p, params.min_tokens, params.max_tokens) == (0.05, 3, 9)
    assert params.logit_bias == ((7, 2.0), (11, -100.0)) and params.adjusts_logits
    assert not parse(presence_penalty=0, logit_bias={}, best_of=None).adjusts_logits


@pytest.mark.parametrize("fields, param", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty="1"), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(min_p=-0.1), "min_p"),
    (dict(min_tokens=17), "min_tokens"), (dict(min_tokens=1.5), "min_tokens"),
    (dict(logit_bias={"100": 1}), "logit_bias"), (dict(logit_bias={"x": 1}), "logit_bias"),
    (dict(logit_bias={"-1": 1}), "logit_bias"), (dict(logit_bias={"5": 101}), "logit_bias"),
    (dict(logit_bias={"5": "1"}), "logit_bias"), (dict(logit_bias=[1]), "logit_bias"),
    (dict(logit_bias={str(i): 1 for i in range(1025)}), "logit_bias"),
    (dict(best_of=2), "best_of"), (dict(max_completion_tokens=0), "max_completion_tokens"),
])
def test_bad_values_are_a_400_naming_the_field(fields, param):
    with pytest.raises(APIError) as caught:
        parse(**fields)
    assert caught.value.status == 400 and caught.value.param == param, caught.value
