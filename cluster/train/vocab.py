"""The draft head's reduced vocabulary: the target tokens it can propose, and the maps both ways.

EAGLE-3 checkpoints store `d2t`, int64 offsets with ``target id = draft id + d2t[draft id]``; draft
ids are the chosen target ids in increasing order (so `d2t` is non-decreasing). A target token
outside the draft vocabulary can never be drafted: training ignores rows whose label is one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftVocab:
    target_ids: torch.Tensor  # [draft_vocab] int64, increasing: draft id -> target id
    target_vocab_size: int

    def __post_init__(self):
        ids = self.target_ids
        assert ids.ndim == 1 and len(ids) >= 1, f"a draft vocabulary needs >= 1 token, got shape {tuple(ids.shape)}"
        assert bool((ids[1:] > ids[:-1]).all()), "draft vocabulary target ids must be strictly increasing"
        assert 0 <= int(ids[0]) and int(ids[-1]) < self.target_vocab_size, (
            f"draft vocabulary ids outside the target's [0, {self.target_vocab_size})")

    @property
    def size(self) -> int:
        return len(self.target_ids)

    @property
    def d2t(self) -> torch.Tensor:
        """[draft_vocab] int64 offsets, as published checkpoints store them."""
        return self.target_ids - torch.arange(self.size)

    def t2d(self) -> torch.Tensor:
        """[target_vocab] int64: target id -> draft id, -1 where the token is not in the draft vocabulary."""
        table = torch.full((self.target_vocab_size,), -1, dtype=torch.int64)
        table[self.target_ids] = torch.arange(self.size)
        return table


def most_frequent(token_lists: Iterable[Iterable[int]], size: int, target_vocab_size: int) -> DraftVocab:
    """The `size` most frequent tokens of `token_lists` (ties: lower id first); when fewer distinct
    tokens occur, the rest are filled with the lowest unseen ids so the head has exactly `size`."""
    if not 1 <= size <= target_vocab_size:
        raise ValueError(f"draft vocabulary size {size} outside [1, {target_vocab_size}] (the target's vocabulary)")
    counts = Counter(t for tokens in token_lists for t in tokens)
    chosen = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:size]]
    seen = set(chosen)
    filler = (t for t in range(target_vocab_size) if t not in seen)
    chosen += [next(filler) for _ in range(size - len(chosen))]
    return DraftVocab(torch.tensor(sorted(chosen), dtype=torch.int64), target_vocab_size)
