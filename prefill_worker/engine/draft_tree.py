"""One request's drafts for its next verify, grown level by level (docs/design.md §6, tree drafting).

A tree of width w and depth D has w nodes per level, D levels, node n at index n (level d holds
nodes ``[w(d - 1), wd)``). Level 1 is the w likeliest tokens after the request's last token; level
d + 1 the w likeliest children of level d's nodes by the draft's cumulative log-probability (EAGLE-2's
expansion, without its re-ranking). Width 1 is a chain: greedy or sampled (`EagleSpeculator._draw`).

Slots, for a request whose last token ``t`` sits at position c::

    verify row   t at slot c (depth 0), node n at slot c + 1 + n, RoPE position c + its depth
    head row     node n at slot c + n of the draft layer, RoPE position c + depth - 1

A level's head call is the last w slots of a window over every node drafted so far, each row seeing
the nodes that are its ancestors (`head_mask`); for a chain that is the causal decode row it was.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels.attention.metadata import TreeMask
from kernels.speculative import ancestor_mask


@dataclass
class DraftTree:
    depth: int  # levels to draft
    width: int  # nodes per level (1: a chain)
    tokens: list[int] = field(default_factory=list)  # node n's token (a target id)
    parents: list[int] = field(default_factory=list)  # node n's parent node (-1: the last token)
    scores: torch.Tensor | None = None  # [w] cumulative draft log-probabilities of the newest level
    probs: list[torch.Tensor] = field(default_factory=list)  # sampled chains: the distribution of each draft

    def level(self, d: int) -> range:
        return range(self.width * (d - 1), self.width * d)

    def head_mask(self, d: int) -> TreeMask | None:
        """Attention of level d's head rows in the window of every node so far (None: a chain, causal)."""
        if self.width == 1:
            return None
        return TreeMask(ancestor_mask(self.parents, list(self.level(d))), (d - 1,) * self.width)

    def verify_parents(self) -> list[int] | None:
        """Each draft's parent as a verify row (`Request.draft_parents`); None for a chain."""
        return None if self.width == 1 else [p + 1 for p in self.parents]

    def grow(self, logprobs: torch.Tensor, to_target_ids) -> list[int]:
        """Add level d + 1 from ``logprobs [m, draft vocab]`` of level d's nodes (m = 1 at the root):
        the w likeliest (node, token) pairs by cumulative log-probability. Returns each new node's
        parent as a row of ``logprobs``."""
        d = len(self.tokens) // self.width
        total = logprobs if self.scores is None else logprobs + self.scores[:, None]
        self.scores, flat = total.flatten().topk(self.width)
        rows = torch.div(flat, logprobs.shape[1], rounding_mode="floor")
        tokens = to_target_ids(flat % logprobs.shape[1]).tolist()
        rows = rows.tolist()
        above = list(self.level(d)) if d else [-1]
        self.tokens += tokens
        self.parents += [above[r] for r in rows]
        return rows

    def append(self, token: int, probs: torch.Tensor | None) -> None:
        """One more draft of a chain."""
        self.parents.append(len(self.tokens) - 1)
        self.tokens.append(token)
        if probs is not None:
            self.probs.append(probs)
