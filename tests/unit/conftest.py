"""Fixtures shared by the tiny-model engine tests."""

import pytest

from tests.helpers import hf_greedy, make_prompts, tiny_models

TINY_MAX_NEW = 24


@pytest.fixture(scope="session")
def prompts():
    """8 random-token prompts of mixed lengths (3..70) for the tiny Llama."""
    return make_prompts(8, min_len=3, max_len=70, seed=1)


@pytest.fixture(scope="session")
def hf_outputs(prompts):
    """HF transformers' greedy continuation (TINY_MAX_NEW tokens) of each of `prompts`."""
    _, ref, _ = tiny_models()
    return [hf_greedy(ref, p, TINY_MAX_NEW) for p in prompts]
