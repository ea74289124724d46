"""Fixtures of the speculative engine tests (chains and trees)."""

import pytest

from tests.helpers import SPEC_MAX_NEW, hf_greedy, make_prompts, tiny_models


@pytest.fixture(scope="session")
def spec_prompts():
    """6 random-token prompts (3..40 tokens) for the tiny Llama."""
    return make_prompts(6, min_len=3, max_len=40, seed=5)


@pytest.fixture(scope="session")
def reference(spec_prompts):
    """prompt (a tuple) -> HF transformers' greedy continuation of SPEC_MAX_NEW tokens."""
    _, ref, _ = tiny_models()
    return {tuple(p): hf_greedy(ref, p, SPEC_MAX_NEW) for p in spec_prompts}
