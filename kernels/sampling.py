"""Token sampling over a batch of logits rows: greedy, temperature, top-k, top-p.

Randomness is stateless per row: the draw for a request's n-th output token depends only on
(`seed`, n), so a request's sampled output does not depend on what else is in the batch, and a
retracted request that resumes draws the same numbers again.
"""

from __future__ import annotations

import torch

from common.config import GREEDY_TEMPERATURE_BELOW

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads consecutive steps over the seed space
_STREAM = 0xD1B54A32D192ED03  # another odd constant: streams of one (seed, step) apart


def row_generator(seed: int, step: int, device: torch.device, stream: int = 0) -> torch.Generator:
    """The generator of a request's draws at output position `step`. `stream` keeps apart draws made
    for different purposes at one position (the sampler 0; speculative drafts and verification others)."""
    g = torch.Generator(device=device)
    g.manual_seed((seed * _MIX + step + stream * _STREAM) % (2**63 - 1))
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
        generator=row_generator(seeds[b], steps[b], dev)) for b in rows])  # [R, V]
    tokens[idx] = (probs / noise).argmax(dim=-1)
    return tokens


def filtered_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The distribution `sample` draws one request's token from, for each row of `logits` [N, V]:
    softmax(logits / temperature) restricted to top-k and the top-p nucleus. float32 [N, V]."""
    n, vocab = logits.shape
    dev = logits.device
    top_k_t = torch.full((n,), min(top_k, vocab), dtype=torch.int64, device=dev)
    top_p_t = torch.full((n,), top_p, dtype=torch.float32, device=dev)
    return _filter_top_k_top_p(logits.float() / temperature, top_k_t, top_p_t).softmax(dim=-1)
