"""Acceptance of draft tokens against the target (docs/design.md §6).

Every verify row names the token the target itself chooses there, and verification accepts drafts
while they equal it. Greedy rows choose the argmax; sampled rows choose the very token the plain
sampler (`kernels.sampling.sample`) would draw at that output position, with the same noise keyed by
(seed, position). So speculation is lossless token for token, not only in distribution: a seeded
request emits the same tokens with drafts or without, however many drafts each step accepted, and a
stream resumed on another worker (which drafts differently) continues exactly. Drafting chooses the
tokens likely to match: a tree's likeliest tokens, or a sampled chain's draw from the draft's
distribution with the target's own noise (the race coupling: the draft matches whenever the two
distributions agree on the winner). Acceptance equals speculative sampling's for drafts that are
chosen (a point-mass draft is accepted with probability p(d) under either rule) and is a little
lower for drawn chains; token identity is worth it (docs/design.md §10).

Trees: the drafts form a tree over the verify row. Row 0 is the request's last token, row i + 1 is
draft i, and ``parents[i]`` is the row of draft i's parent (``parents[i] <= i``; a chain is
``parents[i] == i``). The target scores every row once with a tree mask (each row sees the prefix and
its own ancestors: `verify_tree_mask`) and RoPE positions by depth; a row at depth d chooses the token
of output position (output length + d). `verify_tree` walks from the root to the child that holds
the target's choice, until no child does.
"""

from __future__ import annotations

from kernels.attention.metadata import TreeMask


def is_chain(parents: list[int] | tuple[int, ...]) -> bool:
    """Whether draft i's parent is always draft i - 1 (row i): a chain, verified causally."""
    return all(p == i for i, p in enumerate(parents))


def ancestor_mask(window_parents: list[int], rows: list[int]) -> tuple[tuple[bool, ...], ...]:
    """``visible[i][j]``: window slot j is ``rows[i]`` or one of its ancestors; ``window_parents[j]``
    is slot j's parent slot (-1: none in the window)."""
    out = []
    for row in rows:
        seen = [False] * len(window_parents)
        while row >= 0:
            seen[row] = True
            row = window_parents[row]
        out.append(tuple(seen))
    return tuple(out)


def row_depths(parents: list[int] | tuple[int, ...]) -> list[int]:
    """Depth of every verify row: 0 for the last token, its parent's + 1 for a draft."""
    depths = [0]
    for i, parent in enumerate(parents):
        assert 0 <= parent <= i, f"draft {i}'s parent row {parent} is not before its own row {i + 1}"
        depths.append(depths[parent] + 1)
    return depths


def verify_tree_mask(parents: list[int] | tuple[int, ...]) -> TreeMask:
    """The verify row's attention: window = the row itself, each row sees its ancestors and itself,
    at RoPE position (the row's first position) + depth."""
    window = [-1, *parents]
    return TreeMask(ancestor_mask(window, list(range(len(window)))), tuple(row_depths(parents)))


def _children(parents: list[int] | tuple[int, ...]) -> dict[int, list[int]]:
    """Each tree row's child rows, in row order."""
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(parents):
        children.setdefault(parent, []).append(i + 1)
    return children


def verify_tree(target_tokens: list[int], draft_tokens: list[int],
                parents: list[int] | tuple[int, ...]) -> tuple[list[int], list[int]]:
    """(tokens emitted, rows of the accepted drafts in order): from row 0, emit the target's choice
    and move to the child holding it, until no child does. ``target_tokens``: one id per row."""
    assert len(target_tokens) == len(draft_tokens) + 1 == len(parents) + 1, "one target row per tree row"
    children = _children(parents)
    out: list[int] = []
    path: list[int] = []  # accepted draft rows, root to leaf
    row = 0
    while True:
        want = target_tokens[row]
        out.append(want)
        row = next((c for c in children.get(row, ()) if draft_tokens[c - 1] == want), -1)
        if row < 0:
            return out, path
        path.append(row)


def verify_chain(target_tokens: list[int], draft_tokens: list[int]) -> list[int]:
    """Tokens a chain emits: the longest prefix of the drafts that equals the target's choices, then
    the target's own token at the first mismatch (or the bonus after a full match).
    ``target_tokens``: k + 1 ids (positions 0 .. k); ``draft_tokens``: k ids."""
    assert len(target_tokens) == len(draft_tokens) + 1, "the target scores k + 1 positions for k drafts"
    out = []
    for want, drafted in zip(target_tokens, draft_tokens):
        out.append(want)
        if drafted != want:
            return out
    out.append(target_tokens[-1])
    return out
