"""The reduced draft vocabulary: which target tokens it keeps, and d2t / t2d as published heads use them."""

from __future__ import annotations

import pytest
import torch

from cluster.train.vocab import DraftVocab, most_frequent


def test_most_frequent_keeps_the_commonest_tokens_ties_to_the_lower_id():
    # counts: 5 x3, 9 x3, then 1, 3, 7 once each: the tie goes to 1
    vocab = most_frequent([[5, 5, 9, 9, 3], [7, 5, 9, 1]], size=3, target_vocab_size=10)
    assert vocab.target_ids.tolist() == [1, 5, 9]
    assert vocab.d2t.tolist() == [1, 4, 7]  # target id = draft id + d2t[draft id]
    assert (torch.arange(3) + vocab.d2t).tolist() == [1, 5, 9]
    t2d = vocab.t2d()
    assert t2d.tolist() == [-1, 0, -1, -1, -1, 1, -1, -1, -1, 2]


def test_a_vocabulary_larger_than_the_tokens_seen_is_filled_with_the_lowest_unseen_ids():
    vocab = most_frequent([[4, 4, 7]], size=4, target_vocab_size=10)
    assert vocab.target_ids.tolist() == [0, 1, 4, 7]


@pytest.mark.parametrize("size", [0, 11])
def test_a_draft_vocabulary_outside_the_targets_is_refused(size):
    with pytest.raises(ValueError, match=rf"draft vocabulary size {size} outside \[1, 10\]"):
        most_frequent([[1, 2]], size=size, target_vocab_size=10)


def test_unsorted_or_out_of_range_ids_are_not_a_vocabulary():
    with pytest.raises(AssertionError, match="strictly increasing"):
        DraftVocab(torch.tensor([3, 1]), 10)
    with pytest.raises(AssertionError, match="outside the target's"):
        DraftVocab(torch.tensor([3, 10]), 10)
