"""The logprobs objects of the gateway's responses, as pydantic models for its OpenAPI document
(`router.gateway.logprobs` writes them)."""

from __future__ import annotations

from pydantic import BaseModel, Field


class CompletionLogprobs(BaseModel):
    """A completion choice's `logprobs` (with `logprobs: k`; an echoed prompt's tokens first, the first of
    them with null values)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] = Field(description="The k best tokens and the token itself.")
    text_offset: list[int]


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(BaseModel):
    """A chat choice's `logprobs` (with `logprobs: true`)."""

    content: list[ChatTokenLogprob] | None
    refusal: None = None


class PromptTokenLogprob(BaseModel):
    logprob: float
    rank: int = Field(ge=1)
    decoded_token: str


PromptLogprobs = list[dict[str, PromptTokenLogprob] | None]
"""vLLM's `prompt_logprobs`: per prompt token (null first), token id -> its logprob, rank and text."""
