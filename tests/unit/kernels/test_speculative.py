"""Draft acceptance (kernels/speculative.py) and the sampler it leans on (kernels/sampling.py).

A verify row's choice is the token the plain sampler draws at that output position, so verification
emits, token for token, what sampling without drafts emits: checked on a toy "model" (a seeded
distribution per history) against plain sampling, with random chains and trees of drafts. The
sampler itself draws from the filtered distribution (chi-squared over 20,000 seeds, a test a draw
from the unfiltered distribution fails). A sampled chain drafted with the sampler's noise matches
the target's draw at least as often as the race coupling's bound (1 - TV) / (1 + TV)."""

from __future__ import annotations

import random

import pytest
import torch

from kernels.sampling import filtered_probs, race_noise, sample
from kernels.speculative import verify_chain, verify_tree

VOCAB, TOP_K, SEEDS = 8, 5, 20_000
CHI2_CRITICAL_DOF4 = 18.47  # chi-squared, 4 degrees of freedom, p = 0.001


def test_a_chain_keeps_the_matching_prefix_then_the_targets_token():
    assert verify_chain([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all accepted + bonus
    assert verify_chain([5, 6, 7, 8], [5, 9, 7]) == [5, 6]  # stops at the first mismatch
    assert verify_chain([5, 6, 7, 8], [1, 6, 7]) == [5]
    with pytest.raises(AssertionError, match="k \\+ 1 positions"):
        verify_chain([5, 6], [5, 6])


def _logits(history: tuple[int, ...]) -> torch.Tensor:
    """The toy model: a fixed random logits row per history."""
    return torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(hash(history) % 2**31)) * 2


def _choose(history: tuple[int, ...], seed: int, position: int) -> int:
    return int(sample(_logits(history), [1.0], [TOP_K], [1.0], [seed], [position]))


def _plain(seed: int, n: int) -> list[int]:
    out: list[int] = []
    for i in range(n):
        out.append(_choose(tuple(out), seed, i))
    return out


def _speculated(seed: int, n: int, rng: random.Random, width: int) -> list[int]:
    """Decode with random draft trees (width 1: chains), some nodes on the plain run's path; each row
    chooses at its history and position, as the engine's verify does."""
    truth, out = _plain(seed, n + 4), []
    while len(out) < n:
        tokens, parents, depth_of = [], [], [0]
        for depth in range(1, 4):
            for _ in range(width):
                parent = rng.choice([r for r, d in enumerate(depth_of) if d == depth - 1])
                on_path = rng.random() < 0.6
                tokens.append(truth[len(out) + depth - 1] if on_path else rng.randrange(VOCAB))
                parents.append(parent)
                depth_of.append(depth)
        rows = [()]  # each row's drafted tokens after `out`
        for token, parent in zip(tokens, parents):
            rows.append(rows[parent] + (token,))
        choices = [_choose(tuple(out) + row, seed, len(out) + len(row)) for row in rows]
        emitted = verify_chain(choices, tokens) if width == 1 else verify_tree(choices, tokens, parents)[0]
        out += emitted
    return out[:n]


@pytest.mark.parametrize("width", [1, 3])
def test_verification_emits_the_plain_samplers_tokens_whatever_the_drafts(width):
    rng = random.Random(width)
    for seed in range(40):
        assert _speculated(seed, 12, rng, width) == _plain(seed, 12)


def _chi2(samples: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(samples), minlength=VOCAB).double()
    expected = probs.double() * len(samples)
    support = expected > 0
    if counts[~support].any():
        return float("inf")
    return float(((counts[support] - expected[support]) ** 2 / expected[support]).sum())


def test_the_sampler_draws_from_the_filtered_distribution():
    logits = _logits((1, 2))
    probs = filtered_probs(logits, 1.0, TOP_K, 1.0)[0]
    draws = sample(logits.expand(SEEDS, VOCAB), [1.0] * SEEDS, [TOP_K] * SEEDS, [1.0] * SEEDS,
                   list(range(SEEDS)), [3] * SEEDS).tolist()
    assert _chi2(draws, probs) < CHI2_CRITICAL_DOF4
    assert _chi2(draws, torch.softmax(logits[0], -1)) > 5 * CHI2_CRITICAL_DOF4  # the unfiltered one fails


def test_a_chain_drawn_with_the_samplers_noise_matches_the_targets_draw_often():
    gen = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(VOCAB, generator=gen), -1)
    q = torch.softmax(torch.log(p) + 0.5 * torch.randn(VOCAB, generator=gen), -1)  # a close draft
    tv = float((p - q).abs().sum()) / 2
    n, same, self_same = 4_000, 0, 0
    for seed in range(n):
        noise = race_noise(seed, 0, VOCAB, torch.device("cpu"))
        target = int((p / noise).argmax())
        same += int((q / noise).argmax()) == target
        self_same += int((p / noise).argmax()) == target
    assert self_same == n  # the same distribution: always the target's draw
    assert same / n > (1 - tv) / (1 + tv) - 0.02 and same / n > 0.5
