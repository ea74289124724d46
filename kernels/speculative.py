"""Acceptance of a chain of draft tokens against the target's distributions (docs/design.md §6).

Speculative sampling (Leviathan et al. 2023, Chen et al. 2023): draft token ``d_i`` was drawn from
the draft's distribution ``q_i``; the target's distribution at the same position is ``p_i``::

    for i in 0 .. k-1:
        accept d_i with probability min(1, p_i(d_i) / q_i(d_i))
        on rejection: emit one token from the residual  max(0, p_i - q_i) / its sum,  and stop
    all k accepted: emit a bonus token from p_k

Every emitted token is distributed exactly as the target would have sampled it, so speculation is
lossless in distribution; greedy rows (`verify_greedy`) accept while the draft equals the target's
argmax and are lossless token for token. The functions are pure: the randomness comes in as
arguments (one uniform per draft position, one Exp(1) noise row per emitted-by-sampling position),
so the engine can derive it statelessly per (seed, output position) like `kernels.sampling`.

Trees: the drafts form a tree over the verify row. Row 0 is the request's last token, row i + 1 is
draft i, and ``parents[i]`` is the row of draft i's parent (``parents[i] <= i``; a chain is
``parents[i] == i``). The target scores every row once with a tree mask (each row sees the prefix and
its own ancestors: `verify_tree_mask`) and RoPE positions by depth; verification walks from the root.
Greedy (`verify_tree_greedy`) follows the child that equals the target's argmax. Sampled
(`verify_tree_sampled`): a tree's children are chosen, not drawn (the draft's likeliest tokens), so
each is a draft whose distribution is a point mass, and speculative sampling against a point mass is
"accept with probability p(d), else draw from p without d". At a row with target distribution p::

    r = p
    for each child c (token d_c), in order:
        accept c with probability r(d_c) / sum(r)   -> emit d_c, continue from row c with its own p
        r(d_c) = 0                                  (rejected: the residual loses d_c)
    no child accepted: emit one token drawn from r / sum(r), and stop

Child j is emitted with probability p(d_j) (the rejections before it leave exactly that share), any
other token x with p(x): the row emits a draw from p, and the accepted child's row continues with the
target's distribution after it, so the emitted run follows the target's joint (SpecInfer's multi-
draft rule with deterministic drafts).
"""

from __future__ import annotations

import torch

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


def verify_tree_greedy(target_argmax: list[int], draft_tokens: list[int],
                       parents: list[int] | tuple[int, ...]) -> tuple[list[int], list[int]]:
    """(tokens emitted, rows of the accepted drafts in order): from row 0, emit the target's argmax
    and move to the child holding it, until no child does. ``target_argmax``: one id per row."""
    assert len(target_argmax) == len(draft_tokens) + 1 == len(parents) + 1, "one target row per tree row"
    children = _children(parents)
    out, path, row = [], [], 0
    while True:
        want = target_argmax[row]
        out.append(want)
        row = next((c for c in children.get(row, ()) if draft_tokens[c - 1] == want), -1)
        if row < 0:
            return out, path
        path.append(row)


def verify_tree_sampled(target_probs: torch.Tensor, draft_tokens: list[int], parents: list[int] | tuple[int, ...],
                        uniforms: torch.Tensor, noise: torch.Tensor) -> tuple[list[int], list[int]]:
    """(tokens emitted, rows of the accepted drafts in order) by the multi-draft rule of the module
    docstring. target_probs [n + 1, V] float32: the target's (filtered) distribution at every tree
    row; draft_tokens, parents: the n drafts (chosen, not drawn); uniforms [n] in [0, 1): one per
    draft, used when it is tested; noise [n + 1, V] Exp(1): row r's for the draw that ends at row r."""
    n = len(draft_tokens)
    assert target_probs.shape[0] == n + 1 == len(parents) + 1, "one target row per tree row"
    children = _children(parents)
    out, path, row = [], [], 0
    while True:
        residual, accepted = target_probs[row].clone(), -1
        for child in children.get(row, ()):
            token = draft_tokens[child - 1]
            if uniforms[child - 1].item() * float(residual.sum()) < residual[token].item():
                accepted = child
                break
            residual[token] = 0
        if accepted < 0:
            if float(residual.sum()) <= 0:  # the children held all of p's mass, each rejected with ~0 chance
                residual = target_probs[row]
            out.append(int((residual / noise[row]).argmax()))
            return out, path
        out.append(draft_tokens[accepted - 1])
        path.append(accepted)
        row = accepted


def verify_greedy(target_argmax: list[int], draft_tokens: list[int]) -> list[int]:
    """Tokens emitted by greedy verification: the longest prefix of the draft that equals the target's
    argmax, then the target's own token at the first mismatch (or the bonus after a full match).
    ``target_argmax``: k + 1 ids (positions 0 .. k); ``draft_tokens``: k ids."""
    assert len(target_argmax) == len(draft_tokens) + 1, "the target scores k + 1 positions for k drafts"
    out = []
    for want, drafted in zip(target_argmax, draft_tokens):
        out.append(want)
        if drafted != want:
            return out
    out.append(target_argmax[-1])
    return out


def verify_sampled(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: list[int],
                   uniforms: torch.Tensor, noise: torch.Tensor) -> list[int]:
    """Tokens emitted by speculative sampling (see the module docstring).

    target_probs [k + 1, V] float32, the target's (filtered) distributions at positions 0 .. k;
    draft_probs [k, V] float32, the distributions the drafts were drawn from (over the target's
    vocabulary: zero outside a reduced draft vocabulary); draft_tokens: k ids; uniforms [k] in [0, 1);
    noise [k + 1, V] Exp(1) draws, row i for a token drawn at position i (exponential race: the argmax
    of probs / noise is a draw from probs). Returns 1 .. k + 1 token ids.
    """
    k = len(draft_tokens)
    assert target_probs.shape[0] == k + 1 and draft_probs.shape[0] == k, "k drafts need k + 1 target rows"
    out = []
    for i, d in enumerate(draft_tokens):
        p, q = target_probs[i, d].item(), draft_probs[i, d].item()
        assert q > 0, f"draft token {d} at position {i} has draft probability 0: drawn from another distribution?"
        if uniforms[i].item() < min(1.0, p / q):
            out.append(d)
            continue
        residual = (target_probs[i] - draft_probs[i]).clamp_min(0)
        if residual.sum() <= 0:  # p == q up to rounding: the rejection had probability ~0
            residual = target_probs[i]
        out.append(int((residual / noise[i]).argmax()))
        return out
    out.append(int((target_probs[k] / noise[k]).argmax()))
    return out
