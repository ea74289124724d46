"""Token sampling over a batch of logits rows: greedy, temperature, top-k, top-p.

Randomness is stateless per row: the draw for a request's n-th output token depends only on
(`seed`, n), so a request's sampled output does not depend on what else is in the batch, and a
retracted request that resumes draws the same numbers again.
"""

from __future__ import annotations

import torch

from cluster.config import GREEDY_TEMPERATURE_BELOW

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads consecutive steps over the seed space


def _row_generator(seed: int, step: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((seed * _MIX + step) % (2**63 - 1))
    return g


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens outside top-k / the top-p nucleus with -inf. Always keeps the best token.

    logits [B, V] float32; top_k [B] int64 (0 = off); top_p [B] float32 (1 = off).
    """
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, V]
    rank = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(1)
    drop = rank >= k
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of strictly better tokens
    drop |= mass_before > top_p.unsqueeze(1)
    drop[:, 0] = False
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))


def sample(logits: torch.Tensor, temperatures: list[float], top_ks: list[int], top_ps: list[float],
           seeds: list[int], steps: list[int]) -> torch.Tensor:
    """One token per row. logits [B, V] float32 -> token ids [B] int64 (on logits.device).

    Row b is greedy when temperatures[b] < GREEDY_TEMPERATURE_BELOW (see there why). Otherwise it
    samples with the exponential-race trick (argmax of p / Exp(1) noise), whose noise comes from
    (seeds[b], steps[b]) alone. A top_k of 0 or of at least the vocabulary keeps every token.
    """
    tokens = logits.argmax(dim=-1)
    rows = [b for b, t in enumerate(temperatures) if t >= GREEDY_TEMPERATURE_BELOW]
    if not rows:
        return tokens
    dev, vocab = logits.device, logits.shape[-1]
    idx = torch.tensor(rows, device=dev)
    temp = torch.tensor([temperatures[b] for b in rows], dtype=torch.float32, device=dev).unsqueeze(1)
    # clamped in Python: a k past the vocabulary means "off", and one >= 2^63 would not fit int64
    top_k = torch.tensor([min(top_ks[b], vocab) for b in rows], dtype=torch.int64, device=dev)
    top_p = torch.tensor([top_ps[b] for b in rows], dtype=torch.float32, device=dev)
    probs = _filter_top_k_top_p(logits[idx].float() / temp, top_k, top_p).softmax(dim=-1)  # [R, V]
    noise = torch.stack([torch.empty(logits.shape[-1], device=dev).exponential_(
        generator=_row_generator(seeds[b], steps[b], dev)) for b in rows])  # [R, V]
    tokens[idx] = (probs / noise).argmax(dim=-1)
    return tokens
