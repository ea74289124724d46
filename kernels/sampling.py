"""Token sampling over a batch of logits rows: greedy, temperature, top-k, top-p, min-p; and the
per-request logit rules before it (`adjust_logits`: penalties, biases, min_tokens).

Randomness is stateless per row: the draw for a request's n-th output token depends only on
(`seed`, n), so a request's sampled output does not depend on what else is in the batch, and a
retracted request that resumes draws the same numbers again.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from common.config import GREEDY_TEMPERATURE_BELOW

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads consecutive steps over the seed space


def row_generator(seed: int, step: int, device: torch.device) -> torch.Generator:
    """The generator of a request's draws at output position `step`."""
    g = torch.Generator(device=device)
    g.manual_seed((seed * _MIX + step) % (2**63 - 1))
    return g


def race_noise(seed: int, step: int, vocab: int, device: torch.device) -> torch.Tensor:
    """The Exp(1) noise [vocab] `sample` races a request's distribution against at output position
    `step` (the token is argmax(probs / noise)). Speculative verification and sampled drafts use the
    same numbers, so they choose what the sampler would (`kernels/speculative.py`)."""
    return torch.empty(vocab, device=device).exponential_(generator=row_generator(seed, step, device))


def adjust_logits(logits: torch.Tensor, params, prompt_ids: Sequence[int], output_ids: Sequence[int],
                  stop_ids: Iterable[int] = (), drafts: Sequence[int] = ()) -> torch.Tensor:
    """One request's logits rows [N, V] with its rules applied (a new float32 tensor), in vLLM's
    order: min_tokens (`stop_ids`, the tokens that would end it: EOS unless `ignore_eos`, and
    `stop_token_ids`, at -inf while the output is shorter), `logit_bias`, then the repetition,
    frequency and presence penalties. Row j is the
    position after `output_ids` + `drafts[:j]` (a verify row's rows; a plain row is row 0). Token ids
    past the vocabulary are ignored. `params`: the request's `SamplingParams`."""
    out = logits.float().clone()
    rows, vocab = out.shape
    dev = out.device
    if params.min_tokens > len(output_ids):
        stops = [t for t in stop_ids if t < vocab]
        short = min(rows, params.min_tokens - len(output_ids))  # rows j with len(output) + j < min_tokens
        if stops:
            out[:short, torch.tensor(stops, device=dev)] = float("-inf")
    if params.logit_bias:
        pairs = [(t, b) for t, b in params.logit_bias if t < vocab]
        if pairs:
            ids = torch.tensor([t for t, _ in pairs], device=dev)
            out[:, ids] += torch.tensor([b for _, b in pairs], device=dev)
    if params.repetition_penalty == 1 and not params.frequency_penalty and not params.presence_penalty:
        return out
    counts = _counts([*output_ids, *drafts[:rows - 1]], len(output_ids), rows, vocab, dev)  # [N, V]
    if params.repetition_penalty != 1:
        seen = counts > 0
        prompt = [t for t in prompt_ids if t < vocab]
        if prompt:
            seen[:, torch.tensor(prompt, device=dev)] = True
        penalized = torch.where(out > 0, out / params.repetition_penalty, out * params.repetition_penalty)
        out = torch.where(seen, penalized, out)
    return out - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)


def _counts(ids: list[int], first: int, rows: int, vocab: int, device: torch.device) -> torch.Tensor:
    """[rows, V] float32: row j counts each token among `ids[:first + j]`."""
    kept = torch.tensor([t if t < vocab else vocab for t in ids], dtype=torch.int64, device=device)
    counts = torch.zeros(rows, vocab + 1, device=device)
    counts[0] = torch.bincount(kept[:first], minlength=vocab + 1).float()
    for j in range(1, rows):
        counts[j] = counts[j - 1]
        counts[j, kept[first + j - 1]] += 1
    return counts[:, :vocab]


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                        min_p: torch.Tensor | None = None) -> torch.Tensor:
    """Mask tokens outside top-k / the top-p nucleus / below min-p x the top token's probability with
    -inf. Always keeps the best token.

    logits [B, V] float32; top_k [B] int64 (0 = off); top_p [B] float32 (1 = off); min_p [B] float32 (0 = off).
    """
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, V]
    rank = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(1)
    drop = rank >= k
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of strictly better tokens
    drop |= mass_before > top_p.unsqueeze(1)
    if min_p is not None:
        drop |= probs < min_p.unsqueeze(1) * probs[:, :1]
    drop[:, 0] = False
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))


def sample(logits: torch.Tensor, temperatures: list[float], top_ks: list[int], top_ps: list[float],
           seeds: list[int], steps: list[int], min_ps: list[float] | None = None) -> torch.Tensor:
    """One token per row. logits [B, V] float32 -> token ids [B] int64 (on logits.device).

    Row b is greedy when temperatures[b] < GREEDY_TEMPERATURE_BELOW (see there why). Otherwise it
    samples with the exponential-race trick (argmax of p / Exp(1) noise), whose noise comes from
    (seeds[b], steps[b]) alone. A top_k of 0 or of at least the vocabulary keeps every token; a
    min_p of 0 (None: every row's) keeps every token it would keep.
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
    min_p = None if not min_ps or not any(min_ps[b] for b in rows) else \
        torch.tensor([min_ps[b] for b in rows], dtype=torch.float32, device=dev)
    probs = _filter_top_k_top_p(logits[idx].float() / temp, top_k, top_p, min_p).softmax(dim=-1)  # [R, V]
    noise = torch.stack([race_noise(seeds[b], steps[b], vocab, dev) for b in rows])  # [R, V]
    tokens[idx] = (probs / noise).argmax(dim=-1)
    return tokens


def filtered_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                   min_p: float = 0.0) -> torch.Tensor:
    """The distribution `sample` draws one request's token from, for each row of `logits` [N, V]:
    softmax(logits / temperature) restricted to top-k, the top-p nucleus and min-p. float32 [N, V]."""
    n, vocab = logits.shape
    dev = logits.device
    top_k_t = torch.full((n,), min(top_k, vocab), dtype=torch.int64, device=dev)
    top_p_t = torch.full((n,), top_p, dtype=torch.float32, device=dev)
    min_p_t = torch.full((n,), min_p, dtype=torch.float32, device=dev) if min_p else None
    return _filter_top_k_top_p(logits.float() / temperature, top_k_t, top_p_t, min_p_t).softmax(dim=-1)
