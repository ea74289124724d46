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
"""

from __future__ import annotations

import torch


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
