"""The request fields that change a token's logits before sampling: `presence_penalty`,
`frequency_penalty`, `repetition_penalty` (vLLM's), `logit_bias`, `min_p`, `min_tokens`; each read
and bounded here, an error naming its param, as `SamplingParams` keyword arguments."""

from __future__ import annotations

from typing import Any

from common.config import LOGIT_BIAS_LIMIT, MAX_LOGIT_BIAS
from router.gateway.errors import invalid
from router.gateway.json_body import integer_field, number_field, typed_field


def logit_fields(payload: dict, vocab_size: int, max_tokens: int) -> dict[str, Any]:
    """The fields the request sets (absent or null ones are left out: `SamplingParams`' defaults)."""
    out: dict[str, Any] = {}
    for name in ("presence_penalty", "frequency_penalty"):
        value = number_field(payload, name)
        if value is not None:
            if not -2 <= value <= 2:
                raise invalid(f"`{name}` must be in [-2, 2], got {value}", param=name)
            out[name] = float(value)
    repetition = number_field(payload, "repetition_penalty")
    if repetition is not None:
        if repetition <= 0:
            raise invalid(f"`repetition_penalty` must be > 0 (1: off), got {repetition}", param="repetition_penalty")
        out["repetition_penalty"] = float(repetition)
    min_p = number_field(payload, "min_p")
    if min_p is not None:
        if not 0 <= min_p <= 1:
            raise invalid(f"`min_p` must be in [0, 1], got {min_p}", param="min_p")
        out["min_p"] = float(min_p)
    min_tokens = integer_field(payload, "min_tokens")
    if min_tokens is not None:
        if not 0 <= min_tokens <= max_tokens:
            raise invalid(f"`min_tokens` must be in [0, max_tokens = {max_tokens}], got {min_tokens}",
                          param="min_tokens")
        out["min_tokens"] = min_tokens
    bias = typed_field(payload, "logit_bias", dict)
    if bias:
        out["logit_bias"] = _logit_bias(bias, vocab_size)
    return out


def _logit_bias(bias: dict, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """{"token id": bias} (JSON keys are strings) -> sorted (id, bias) pairs."""
    if len(bias) > MAX_LOGIT_BIAS:
        raise invalid(f"`logit_bias` may name {MAX_LOGIT_BIAS} tokens at most, got {len(bias)}", param="logit_bias")
    pairs = []
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.strip().lstrip("-").isdigit() else None
        if token is None or not 0 <= token < vocab_size:
            raise invalid(f"`logit_bias` keys must be token ids in [0, {vocab_size}), got {key!r}", param="logit_bias")
        amount = number_field({"logit_bias": value}, "logit_bias")
        if amount is None or abs(amount) > LOGIT_BIAS_LIMIT:
            raise invalid(f"`logit_bias` values must be numbers in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}], "
                          f"got {value!r} for {key}", param="logit_bias")
        pairs.append((token, float(amount)))
    return tuple(sorted(pairs))
