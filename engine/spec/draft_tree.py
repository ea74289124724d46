"""One request's drafts for its next verify, grown level by level (docs/design.md §6, tree drafting).

EAGLE-2's dynamic tree with width w and depth D. Level 1 is the w likeliest tokens after the
request's last token. Each level's w *frontier* nodes are expanded by the head: each gets its w
likeliest children as *candidates*, scored by cumulative draft log-probability, and the w best of
those become the next frontier. The verify takes the N best candidates of all levels (`select`; a
child never scores above its parent, so they form a tree). Greedy and sampled requests grow the
same trees (verification follows the target's choice: `kernels.speculative.verify_tree`). Width 1 is
a chain: greedy, or drawn from the head's filtered distribution with the sampler's noise
(`EagleSpeculator._draw`), every node verified.

Slots, for a request whose last token ``t`` sits at position c::

    verify row   t at slot c (depth 0), selected node i at slot c + 1 + i, RoPE position c + depth
    head row     frontier node f (in frontier order) at slot c + f of the draft layer, RoPE
                 position c + depth - 1

A level's head call is the last w slots of a window over the frontier so far, each row seeing its
ancestors (`head_mask`); for a chain that is the causal decode row it was.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kernels.attention.metadata import TreeMask
from kernels.kv_layout import KVCacheTensors
from kernels.speculative import ancestor_mask


@dataclass
class DraftTree:
    depth: int  # levels to draft
    width: int  # frontier nodes per level (1: a chain)
    tokens: list[int] = field(default_factory=list)  # candidate n's token (a target id)
    parents: list[int] = field(default_factory=list)  # candidate n's parent candidate (-1: the last token)
    scores: list[float] = field(default_factory=list)  # candidate n's cumulative draft log-probability
    frontier: list[int] = field(default_factory=list)  # the expanded candidates, level by level (w per level)

    @property
    def levels(self) -> int:
        return len(self.frontier) // self.width

    def level_tokens(self, d: int) -> list[int]:
        return [self.tokens[n] for n in self.frontier[self.width * (d - 1):self.width * d]]

    def head_mask(self, d: int) -> TreeMask | None:
        """Attention of level d's head rows in the window of the frontier so far (None: a chain)."""
        if self.width == 1:
            return None
        window = self.frontier[:self.width * d]
        at = {n: f for f, n in enumerate(window)}
        parents = [at.get(self.parents[n], -1) for n in window]
        return TreeMask(ancestor_mask(parents, list(range(self.width * (d - 1), self.width * d))),
                        (d - 1,) * self.width)

    def grow(self, logprobs: torch.Tensor, to_target_ids: Callable[[torch.Tensor], torch.Tensor]) -> list[int]:
        """Level d + 1 from ``logprobs [m, draft vocab]`` of level d's frontier (m = 1 at the root):
        each row's w likeliest children become candidates, the w best of them the new frontier.
        Returns each new frontier node's parent as a row of ``logprobs``."""
        d, w = self.levels, self.width
        above = self.frontier[w * (d - 1):] if d else [-1]
        base = torch.tensor([self.scores[n] if n >= 0 else 0.0 for n in above], device=logprobs.device)
        values, ids = logprobs.topk(w, dim=-1)  # [m, w]
        total = (values + base[:, None]).flatten()
        best = total.topk(w).indices.tolist()
        first = len(self.tokens)
        self.tokens += to_target_ids(ids.flatten()).tolist()
        self.parents += [above[i // w] for i in range(total.numel())]
        self.scores += total.tolist()
        self.frontier += [first + i for i in best]
        return [i // w for i in best]

    def append(self, token: int) -> None:
        """One more draft of a chain."""
        self.parents.append(len(self.tokens) - 1)
        self.tokens.append(token)
        self.scores.append(0.0)
        self.frontier.append(len(self.tokens) - 1)

    def select(self, num_nodes: int) -> tuple[list[int], list[int] | None]:
        """(tokens, each one's parent as a verify row, or None for a chain) of the `num_nodes` best
        candidates (all of a chain's), in candidate order: a parent before its children."""
        if self.width == 1:
            return self.tokens, None
        ranked = sorted(range(len(self.tokens)), key=lambda n: (-self.scores[n], n))[:num_nodes]
        chosen = sorted(ranked)
        row = {n: i + 1 for i, n in enumerate(chosen)}
        assert all(self.parents[n] < 0 or self.parents[n] in row for n in chosen), "a chosen node lost its parent"
        return [self.tokens[n] for n in chosen], [row.get(self.parents[n], 0) for n in chosen]


SlotMove = Callable[[torch.Tensor, torch.Tensor], None]
"""A speculator's K/V move, `move(src, dst)`: `move_slots` over its target's KV, or one sent on to every rank
first (`engine/tp.py:lead_moves`)."""


def move_slots(kv: KVCacheTensors | None, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy the K/V of flat slots `src` to slots `dst` in every layer of `kv`:
    a verified tree's accepted rows to the chain after the last committed token."""
    assert kv is not None, "a tree's accepted path moved by a speculator made without the target's KV (target_kv)"
    for cache in (*kv.k, *kv.v):
        flat = cache.view(-1, *cache.shape[2:])
        flat.index_copy_(0, dst, flat.index_select(0, src))
