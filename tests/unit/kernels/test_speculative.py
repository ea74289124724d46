"""Draft acceptance (kernels/speculative.py): greedy verification emits exactly the target's greedy
tokens; speculative sampling emits tokens distributed as the target's, checked by a chi-squared test
on 20,000 chains (the first emitted token against p_0, the second, where there is one, against p_1),
a test that fails for a deliberately biased acceptance rule (accept every draft)."""

from __future__ import annotations

import pytest
import torch

from kernels.speculative import verify_greedy, verify_sampled

VOCAB, K, CHAINS = 8, 3, 20_000
CHI2_CRITICAL_DOF7 = 24.32  # chi-squared, 7 degrees of freedom, p = 0.001


def test_greedy_keeps_the_matching_prefix_then_the_targets_token():
    assert verify_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all accepted + bonus
    assert verify_greedy([5, 6, 7, 8], [5, 9, 7]) == [5, 6]  # stops at the first mismatch
    assert verify_greedy([5, 6, 7, 8], [1, 6, 7]) == [5]
    with pytest.raises(AssertionError, match="k \\+ 1 positions"):
        verify_greedy([5, 6], [5, 6])


def _chains(accept_all: bool, seed: int = 0) -> tuple[torch.Tensor, list[list[int]]]:
    gen = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(K + 1, VOCAB, generator=gen) * 1.5, -1)
    draft = torch.softmax(torch.randn(K, VOCAB, generator=gen) * 1.5, -1)
    draft[0, 3] = 0  # a token the draft never proposes (outside a reduced draft vocabulary)
    draft = draft / draft.sum(-1, keepdim=True)
    out = []
    for _ in range(CHAINS):
        tokens = [int(t) for t in torch.multinomial(draft, 1, generator=gen)[:, 0]]
        uniforms = torch.zeros(K) if accept_all else torch.rand(K, generator=gen)
        noise = torch.empty(K + 1, VOCAB).exponential_(generator=gen)
        out.append(verify_sampled(target, draft, tokens, uniforms, noise))
    return target, out


def _chi2(samples: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(samples), minlength=VOCAB).double()
    expected = probs.double() * len(samples)
    return float(((counts - expected) ** 2 / expected).sum())


def test_emitted_tokens_follow_the_targets_distribution():
    target, chains = _chains(accept_all=False)
    assert all(1 <= len(c) <= K + 1 for c in chains)
    assert _chi2([c[0] for c in chains], target[0]) < CHI2_CRITICAL_DOF7
    seconds = [c[1] for c in chains if len(c) >= 2]
    assert len(seconds) > 5_000
    assert _chi2(seconds, target[1]) < CHI2_CRITICAL_DOF7
    # token 3 is never drafted at position 0, yet the target's share of it comes out (residual draws)
    assert sum(c[0] == 3 for c in chains) > 0.5 * target[0, 3] * CHAINS


def test_a_biased_rule_that_accepts_every_draft_fails_the_same_test():
    target, chains = _chains(accept_all=True)
    assert _chi2([c[0] for c in chains], target[0]) > 10 * CHI2_CRITICAL_DOF7
