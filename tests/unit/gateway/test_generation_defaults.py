"""The generation config: which sampling fills a request's unset fields (the model's recommended
values, or the OpenAI API's), and that a request's own fields always win."""

from __future__ import annotations

import json

import pytest

from cluster.serve.config import GatewayConfig
from cluster.serve.config_load import load_serve_config
from common.config import ConfigError, SamplingDefaults
from kernels.model.generation_config import SMOLLM2_CARD, sampling_defaults
from router.gateway.errors import APIError
from router.gateway.schema import ModelLimits, parse_completion

VOCAB = 1000


def limits(sampling: SamplingDefaults) -> ModelLimits:
    return ModelLimits("m", max_model_len=64, vocab_size=VOCAB, default_max_tokens=8, max_prompt_tokens=None,
                       sampling=sampling)


def params(sampling: SamplingDefaults, **body):
    return parse_completion({"model": "m", "prompt": [5, 6, 7], **body}, None, limits(sampling)).params


def test_the_bundled_model_gets_its_model_cards_sampling_and_none_gets_the_openai_defaults(tmp_path):
    auto = sampling_defaults("auto", "smollm2", tmp_path)
    assert auto == SMOLLM2_CARD and (auto.temperature, auto.top_p, auto.top_k) == (0.2, 0.9, 0)
    none = sampling_defaults("none", "smollm2", tmp_path)
    assert (none.temperature, none.top_p, none.top_k) == (1.0, 1.0, 0) and "none" in none.source


def test_a_local_model_dir_gives_its_generation_config_json(tmp_path):
    assert sampling_defaults("auto", str(tmp_path), tmp_path) == SamplingDefaults(
        source=f"the OpenAI API's defaults ({tmp_path} has no generation_config.json)")
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps({"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": 2}))
    assert sampling_defaults("auto", str(tmp_path), tmp_path) == SamplingDefaults(0.6, 0.95, 20, str(path))
    path.write_text(json.dumps({"temperature": 0.7}))  # only what it names
    assert sampling_defaults("auto", str(tmp_path), tmp_path) == SamplingDefaults(0.7, 1.0, 0, str(path))
    for bad in ("{not json", json.dumps({"top_p": 1.5}), json.dumps([1])):
        path.write_text(bad)
        with pytest.raises(ConfigError, match="generation_config.json"):
            sampling_defaults("auto", str(tmp_path), tmp_path)
    with pytest.raises(ConfigError, match="generation_config"):
        sampling_defaults("greedy", "smollm2", tmp_path)


def test_unset_fields_take_the_defaults_and_set_fields_win():
    card = SMOLLM2_CARD
    p = params(card)
    assert (p.temperature, p.top_p, p.top_k) == (0.2, 0.9, 0)
    p = params(card, temperature=0, top_p=1, top_k=-1)
    assert (p.temperature, p.top_p, p.top_k) == (0.0, 1.0, 0)
    p = params(card, temperature=1.1)
    assert (p.temperature, p.top_p) == (1.1, 0.9)
    p = params(SamplingDefaults(0.6, 0.8, 20, "file"))
    assert (p.temperature, p.top_p, p.top_k) == (0.6, 0.8, 20)
    assert params(SamplingDefaults(0.6, 0.8, VOCAB + 5, "file")).top_k == 0  # past the vocabulary: off
    p = params(SamplingDefaults())
    assert (p.temperature, p.top_p, p.top_k) == (1.0, 1.0, 0)
    with pytest.raises(APIError):  # a bad value is still the request's error, whatever the defaults
        params(card, top_p=0)


def test_the_knob_is_bounded_and_reaches_the_gateway_config():
    assert GatewayConfig().generation_config == "auto"
    assert load_serve_config(None, {"gateway.generation_config": "none"}).gateway.generation_config == "none"
    with pytest.raises(ConfigError, match="generation_config"):
        GatewayConfig(generation_config="model")
    for bad in (dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-2), dict(temperature=float("nan"))):
        with pytest.raises(ConfigError):
            SamplingDefaults(**bad)
