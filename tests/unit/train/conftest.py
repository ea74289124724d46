"""Builders for the draft-head training tests: the seeded tiny Llama as the target, its greedy answers
to random-token prompts through the colocated engine, and heads with every parameter random."""

from __future__ import annotations

import functools

import pytest
import torch

from cluster.train.checkpoint import new_head, trainable
from cluster.train.data import Sample, aux_states, generate, target_states
from cluster.train.settings import TrainSettings
from cluster.train.trainer import make_example
from cluster.train.vocab import most_frequent
from tests.helpers import make_prompts, tiny_models

DRAFT_VOCAB = 64


@functools.cache
def tiny_corpus(num_prompts: int = 12, max_new_tokens: int = 20) -> tuple[list[Sample], list[torch.Tensor]]:
    """The tiny target's greedy answers to random prompts (no EOS: full length), and their aux states."""
    target, _, arch = tiny_models()
    prompts = make_prompts(num_prompts, min_len=3, max_len=24, seed=5, vocab=arch.vocab_size)
    samples = generate(target, arch, (), prompts, max_new_tokens, max_running=8)
    return samples, aux_states(target, samples, AUX_IDS, tokens_per_pass=100)


AUX_IDS = (1, 1, 0)


@functools.cache
def tiny_target_hidden(num_prompts: int = 12, max_new_tokens: int = 20) -> list[torch.Tensor]:
    """The tiny target's final hidden states over each `tiny_corpus` sequence (soft labels)."""
    samples, _ = tiny_corpus(num_prompts, max_new_tokens)
    return [hidden for _, hidden in target_states(tiny_models()[0], samples, AUX_IDS, tokens_per_pass=100)]


def tiny_target_head(vocab) -> torch.Tensor:
    """The tiny target's lm_head columns of the draft ids ``[h, draft_vocab]``."""
    return tiny_models()[0].lm_head.weight.detach()[vocab.target_ids].t().clone()


def tiny_vocab(samples: list[Sample]):
    return most_frequent([s.answer for s in samples], DRAFT_VOCAB, tiny_models()[2].vocab_size)


def tiny_examples(samples, aux, vocab, hidden=None):
    t2d = vocab.t2d()
    hidden = hidden or [None] * len(samples)
    return [make_example(s, a, t2d, h) for s, a, h in zip(samples, aux, hidden)]


def random_head(vocab, seed: int = 3):
    """A head for the tiny target with every own parameter (norms included) random."""
    head = new_head(tiny_models()[0], vocab, seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in trainable(head).values():
            param.copy_(torch.randn(param.shape, generator=gen) * (0.3 if param.ndim > 1 else 0.2) + (param.ndim == 1))
    return head.eval()


@pytest.fixture
def settings() -> TrainSettings:
    return TrainSettings(num_prompts=12, max_new_tokens=20, draft_vocab_size=DRAFT_VOCAB, epochs=5, batch_size=4,
                         lr=1e-2, seed=1)
