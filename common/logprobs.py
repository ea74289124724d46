"""One position's log-probabilities, as they travel from a worker to the gateway (no torch)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprobs:
    """The model's log-softmax at one position (before any logit rule, temperature or mask: vLLM's
    `raw_logprobs`) for the token that came next there, its rank, and the most likely tokens."""

    logprob: float
    rank: int
    """1 + the number of tokens more likely than it."""
    top: tuple[tuple[int, float], ...] = ()
    """(token id, logprob) of the most likely tokens, best first (as many as the request asked)."""
