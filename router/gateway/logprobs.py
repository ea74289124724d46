"""Logprobs in the OpenAI API: the request fields that ask for them, and the response shapes.

    chat         `logprobs: true` with `top_logprobs` (0-20) -> choice.logprobs.content[...]
    completions  `logprobs: k` (0-20) -> choice.logprobs {tokens, token_logprobs, top_logprobs, text_offset};
                 `echo: true` puts the prompt's text (and, with `logprobs`, its tokens) first, and
                 `max_tokens: 0` with `echo` scores the prompt alone (an evaluation harness's
                 loglikelihood request)
    both         `prompt_logprobs: k` (vLLM's): each prompt token's logprob, rank and the k best,
                 keyed by token id (chat: the body's `prompt_logprobs`; completions: each choice's)

Values are the model's raw log-softmax (`engine.logprobs`). A completion's `top_logprobs` always
holds the token that came there too (as vLLM's do), so it may have k + 1 entries.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from common.config import MAX_LOGPROBS
from common.logprobs import TokenLogprobs
from router.gateway.errors import invalid
from router.gateway.json_body import as_int, integer_field, typed_field

Entry = tuple[int, TokenLogprobs | None]
"""A token and its logprobs (None: the prompt's first token, which nothing predicts)."""


@dataclass(frozen=True)
class LogprobAsk:
    """What a request asked for beyond its sampling parameters."""

    echo: bool = False  # a completion's text starts with its prompt's (and its logprobs, with its tokens)
    prompt_only: bool = False  # echo with `max_tokens: 0`: the prompt is scored, no token is returned
    echo_logprobs_only: bool = False  # the prompt's logprobs are asked for by echo alone: none in `prompt_logprobs`


def completion_fields(payload: dict) -> tuple[dict[str, Any], LogprobAsk]:
    """A completion's `logprobs` (an integer), `echo`, `prompt_logprobs`: (SamplingParams fields,
    the ask). `echo` with `max_tokens: 0` is `prompt_only`: the engine is asked for one token,
    which the response leaves out."""
    logprobs = _count(payload, "logprobs")
    prompt = _count(payload, "prompt_logprobs")
    echo = bool(typed_field(payload, "echo", bool))
    prompt_only = echo and as_int(payload.get("max_tokens")) == 0
    echo_only = echo and logprobs is not None and prompt is None
    if echo and logprobs is not None:
        prompt = max(prompt or 0, logprobs)
    return _fields(logprobs, prompt), LogprobAsk(echo, prompt_only, echo_only)


def chat_fields(payload: dict) -> dict[str, Any]:
    """A chat's `logprobs` (a boolean) with `top_logprobs`, and `prompt_logprobs`: SamplingParams fields."""
    wanted = bool(typed_field(payload, "logprobs", bool))
    top = _count(payload, "top_logprobs")
    if top is not None and not wanted:
        raise invalid("`top_logprobs` needs `logprobs: true`", param="top_logprobs")
    return _fields((top or 0) if wanted else None, _count(payload, "prompt_logprobs"))


def _fields(logprobs: int | None, prompt: int | None) -> dict[str, Any]:
    out = {}
    if logprobs is not None:
        out["logprobs"] = logprobs
    if prompt is not None:
        out["prompt_logprobs"] = prompt
    return out


def _count(payload: dict, name: str) -> int | None:
    if isinstance(payload.get(name), bool):
        raise invalid(f"`{name}` must be an integer in [0, {MAX_LOGPROBS}], got a boolean", param=name)
    value = integer_field(payload, name)
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise invalid(f"`{name}` must be an integer in [0, {MAX_LOGPROBS}], got {value}", param=name)
    return value


class TokenText:
    """Token ids -> their text one by one (as logprobs name tokens), cached per id."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode([token_id])
        return text


def chat_content(text_of: TokenText, entries: Sequence[Entry]) -> list[dict]:
    """`choice.logprobs.content` of the output tokens `entries`."""
    def item(token: int, logprob: float) -> dict:
        text = text_of(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return [{**item(token, lp.logprob), "top_logprobs": [item(t, v) for t, v in lp.top]}
            for token, lp in entries if lp is not None]


def completion_logprobs(text_of: TokenText, entries: Sequence[Entry], offset: int) -> tuple[dict, int]:
    """(`choice.logprobs` of `entries`, the text offset after them); `offset`: where their text starts."""
    body: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, lp in entries:
        text = text_of(token)
        body["tokens"].append(text)
        body["text_offset"].append(offset)
        offset += len(text)
        if lp is None:
            body["token_logprobs"].append(None)
            body["top_logprobs"].append(None)
            continue
        body["token_logprobs"].append(lp.logprob)
        top = {text_of(t): v for t, v in lp.top}
        top.setdefault(text, lp.logprob)
        body["top_logprobs"].append(top)
    return body, offset


def prompt_logprobs_body(text_of: TokenText, prompt: Sequence[int],
                         values: Sequence[TokenLogprobs | None]) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token, None first, then {token id: {logprob, rank,
    decoded_token}} for the token itself and the best ones."""
    out: list[dict | None] = []
    for token, lp in zip(prompt, values):
        if lp is None:
            out.append(None)
            continue
        ranked = {t: (v, rank) for rank, (t, v) in enumerate(lp.top, 1)}
        ranked[token] = (lp.logprob, lp.rank)
        out.append({str(t): {"logprob": v, "rank": rank, "decoded_token": text_of(t)}
                    for t, (v, rank) in ranked.items()})
    return out
