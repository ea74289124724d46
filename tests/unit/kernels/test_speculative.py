"""Draft acceptance (kernels/speculative.py): greedy verification emits exactly the target's greedy
tokens; speculative sampling emits tokens distributed as the target's, checked by a chi-squared test
on 20,000 chains (the first emitted token against p_0, the second, where there is one, against p_1),
a test that fails for a deliberately biased acceptance rule (accept every draft). Trees of chosen
drafts (`verify_tree_sampled`): every emitted run follows the target's joint along the tree, and the
same test fails when rejected siblings are not taken out of the residual."""

from __future__ import annotations

import pytest
import torch

from kernels.speculative import verify_greedy, verify_sampled, verify_tree_sampled

VOCAB, K, CHAINS = 8, 3, 20_000
CHI2_CRITICAL_DOF7 = 24.32  # chi-squared, 7 degrees of freedom, p = 0.001
CHI2_CRITICAL_DOF6 = 22.46


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
    """Over the tokens `probs` can produce (any sample outside them: infinite)."""
    counts = torch.bincount(torch.tensor(samples), minlength=VOCAB).double()
    expected = probs.double() * len(samples)
    support = expected > 0
    if counts[~support].any():
        return float("inf")
    return float(((counts[support] - expected[support]) ** 2 / expected[support]).sum())


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


# ---- trees of chosen drafts ----------------------------------------------------------------------
# row 0's children: rows 1, 2, 3 (tokens 2, 5, 0); row 1's: rows 4, 5 (tokens 4, 1)
TREE_TOKENS, TREE_PARENTS, TREES = [2, 5, 0, 4, 1], [0, 0, 0, 1, 1], 20_000


def _tree_runs(rule=verify_tree_sampled, seed: int = 1) -> tuple[torch.Tensor, list[list[int]]]:
    gen = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(len(TREE_TOKENS) + 1, VOCAB, generator=gen) * 1.5, -1)
    target[0, 0] = 0  # the third child of the root has target probability 0: never accepted
    target[0, 2] += 0.5  # enough runs two levels down for the test: 2, then 4
    target[1, 4] += 0.5
    target /= target.sum(-1, keepdim=True)
    runs = []
    for _ in range(TREES):
        uniforms = torch.rand(len(TREE_TOKENS), generator=gen)
        noise = torch.empty(len(TREE_TOKENS) + 1, VOCAB).exponential_(generator=gen)
        out, path = rule(target, TREE_TOKENS, TREE_PARENTS, uniforms, noise)
        assert [TREE_TOKENS[r - 1] for r in path] == out[:len(path)] and len(out) == len(path) + 1
        runs.append(out)
    return target, runs


def test_a_tree_of_chosen_drafts_emits_the_targets_joint_along_the_tree():
    target, runs = _tree_runs()
    assert _chi2([r[0] for r in runs], target[0]) < CHI2_CRITICAL_DOF6  # token 0: p = 0, never emitted
    for first, row in ((2, 1), (5, 2)):  # after an accepted child, its own row's distribution
        seconds = [r[1] for r in runs if r[0] == first]
        assert len(seconds) > 1_000
        assert _chi2(seconds, target[row]) < CHI2_CRITICAL_DOF7
    thirds = [r[2] for r in runs if r[:2] == [2, 4]]  # two levels down
    assert len(thirds) > 1_000 and _chi2(thirds, target[4]) < CHI2_CRITICAL_DOF7
    assert all(len(r) == 1 or r[0] in (2, 5) for r in runs) and max(map(len, runs)) == 3


def test_a_rejected_sibling_leaves_the_residual_and_the_next_sibling_takes_its_share():
    probs = torch.zeros(3, VOCAB)
    probs[0, 2] = probs[0, 5] = 0.5
    probs[1:, 7] = 1.0
    noise = torch.ones(3, VOCAB)
    # child 1 (token 2) rejected (u = 0.9 >= 0.5); child 2 (token 5) then holds all of the residual
    assert verify_tree_sampled(probs, [2, 5], [0, 0], torch.tensor([0.9, 0.99]), noise) == ([5, 7], [2])
    assert verify_tree_sampled(probs, [2, 5], [0, 0], torch.tensor([0.1, 0.99]), noise) == ([2, 7], [1])


def _no_residual(target, tokens, parents, uniforms, noise):
    """Biased: each child accepted with its own p(d), rejected siblings left in the distribution."""
    out, path, row = [], [], 0
    while True:
        child = next((c for c, parent in enumerate(parents, 1)
                      if parent == row and uniforms[c - 1] < target[row, tokens[c - 1]]), -1)
        if child < 0:
            out.append(int((target[row] / noise[row]).argmax()))
            return out, path
        out.append(tokens[child - 1])
        path.append(child)
        row = child


def test_the_same_tree_test_fails_when_rejected_siblings_stay_in_the_residual():
    target, runs = _tree_runs(_no_residual)
    assert _chi2([r[0] for r in runs], target[0]) > 10 * CHI2_CRITICAL_DOF7
