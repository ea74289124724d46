"""Chain acceptance's index arithmetic on drafts fixed by hand: which row of which step is compared
with which target token, where a chain stops, and how verifies advance."""

from __future__ import annotations

import pytest
import torch

import cluster.train.evaluate as evaluate
from cluster.train.data import Sample
from cluster.train.vocab import DraftVocab

TOKENS = tuple(range(10))  # t[i] = i; prompt t[0..3)
WRONG = {1: {5}, 2: set(range(9)) - {4}}  # step -> rows whose draft is wrong (step 0: all right)


def _fake_unrolled(head, input_ids, aux, num_steps):
    """x of step s at row i = one-hot of its draft id: t[i+2] unless row i is in WRONG[s]."""
    rows = input_ids.shape[1]
    xs = []
    for step in range(num_steps):
        guess = torch.tensor([(i + 2) % 10 if i not in WRONG.get(step, ()) else 0 for i in range(rows)])
        xs.append(torch.nn.functional.one_hot(guess, 10).float()[None])
    return xs


def test_chain_acceptance_counts_matching_prefixes_and_engine_like_rounds(monkeypatch):
    monkeypatch.setattr(evaluate, "unrolled_forward", _fake_unrolled)
    monkeypatch.setattr(evaluate, "logits", lambda head, x: x)
    sample = Sample(TOKENS, prompt_len=3)
    result = evaluate.chain_acceptance(None, [sample], [torch.zeros(10, 3)], DraftVocab(torch.arange(10), 10), 3)
    # n = 3..8: d1 = step 0 row n-1, d2 = step 1 row n, d3 = step 2 row n+1, cut at the sequence's end
    per_position = [3, 2, 1, 2, 2, 1]
    assert result.num_positions == len(per_position)
    assert result.per_position_len == pytest.approx(sum(a + 1 for a in per_position) / 6)
    # verifies: n = 3 accepts 3 -> n = 7 accepts 2 -> n = 10, past the end
    assert result.num_rounds == 2
    assert result.mean_accepted_len == pytest.approx((4 + 3) / 2)
    assert result.step_accept == pytest.approx((1.0, 4 / 6, 1 / 4))


def test_an_answer_of_one_token_has_no_verify(monkeypatch):
    monkeypatch.setattr(evaluate, "unrolled_forward", _fake_unrolled)
    monkeypatch.setattr(evaluate, "logits", lambda head, x: x)
    result = evaluate.chain_acceptance(None, [Sample(TOKENS[:4], prompt_len=3)], [torch.zeros(4, 3)],
                                       DraftVocab(torch.arange(10), 10), 3)
    assert result.num_rounds == 0 and result.num_positions == 0
