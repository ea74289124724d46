"""OpenAI response bodies and SSE frames, one class per endpoint (chosen by name, not by flags).

Streamed frames of one request, in order:

    chat:        role chunk {"role": "assistant", "content": ""} | content chunks | finish chunk
                 (empty delta, finish_reason) | usage chunk (choices == [], only when asked) | [DONE]
    completion:  text chunks | finish chunk (text "", finish_reason) | usage chunk (when asked) | [DONE]

A failure after the first frame is one `data: {"error": ...}` frame, then `data: [DONE]`.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from common.logprobs import TokenLogprobs
from router.gateway.errors import APIError
from router.gateway.logprobs import Entry, TokenText, chat_content, completion_logprobs, prompt_logprobs_body
from router.gateway.schema import Endpoint
from router.gateway.tool_parsers import ToolCall

SSE_DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cached_tiers: tuple[int, int, int] | tuple[()] = ()  # by the tier that held them (device, host, L3); () unknown

    def body(self) -> dict:
        details: dict = {"cached_tokens": self.cached_tokens}
        if self.cached_tiers:
            details["cached_tokens_details"] = dict(zip(("device", "host", "l3"), self.cached_tiers))
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens, "prompt_tokens_details": details}


@dataclass(frozen=True)
class TokenIds:
    """A request's prompt token ids (a session's history included) and every output token id."""

    prompt: tuple[int, ...]
    output: tuple[int, ...]


@dataclass(frozen=True)
class Delta:
    """Text for the client, and the logprobs of the tokens since the last delta (when asked)."""

    text: str
    logprobs: tuple[Entry, ...] = ()
    prompt: bool = False  # an echoed prompt: its text, and its tokens' logprobs
    tool_calls: tuple[ToolCall, ...] = ()  # the output's tool calls (with the last delta)


@dataclass(frozen=True)
class Choice:
    """One finished choice of a non-streaming body."""

    text: str
    finish_reason: str
    token_ids: TokenIds | None = None  # with `return_token_ids`
    logprobs: tuple[Entry, ...] | None = None  # when asked (an echoed prompt's first)
    prompt: tuple[int, ...] = ()  # its prompt, for `prompt_logprobs`
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None  # when asked
    tool_calls: tuple[ToolCall, ...] = ()


def sse(body: dict) -> bytes:
    return b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def sse_error(err: APIError) -> bytes:
    return sse(err.body())


class ResponseShape:
    """The bodies of one request's response; `id`, `created` and `model` are shared by all its frames."""

    id_prefix = ""
    object_name = ""
    chunk_object_name = ""

    def __init__(self, model: str, tokenizer: Any = None):
        """`tokenizer`: names the tokens of logprobs (None: a request without them)."""
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self._text_of = TokenText(tokenizer)

    def opening_frames(self, index: int = 0) -> list[bytes]:
        """Frames sent before the first token's text of choice `index`."""
        return []

    def delta_frame(self, delta: Delta, index: int = 0) -> bytes:
        return sse(self._chunk(self._delta_choice(delta, None, index)))

    def finish_frame(self, finish_reason: str, index: int = 0) -> bytes:
        return sse(self._chunk(self._delta_choice(Delta(""), finish_reason, index)))

    def usage_frame(self, usage: Usage) -> bytes:
        return sse({**self._chunk(None), "choices": [], "usage": usage.body()})

    def full_choices(self, choices: list[Choice], usage: Usage) -> dict:
        """The non-streaming body of a request's choices (several with `n` or a batch of prompts), in
        index order; with token ids (`return_token_ids`), the prompt's and the output's where vLLM
        puts them."""
        body: dict[str, Any] = {"id": self.id, "object": self.object_name, "created": self.created,
                                "model": self.model, "choices": [], "usage": usage.body()}
        for index, choice in enumerate(choices):
            item = self._full_choice(choice, index)
            body["choices"].append(item)
            if choice.token_ids is not None:
                self._add_token_ids(body, item, choice.token_ids)
            if choice.prompt_logprobs is not None:
                self._add_prompt_logprobs(body, item, prompt_logprobs_body(self._text_of, choice.prompt,
                                                                           choice.prompt_logprobs))
        return body

    def _add_token_ids(self, body: dict, choice: dict, token_ids: TokenIds) -> None:
        choice["prompt_token_ids"], choice["token_ids"] = list(token_ids.prompt), list(token_ids.output)

    def _add_prompt_logprobs(self, body: dict, choice: dict, values: list) -> None:
        choice["prompt_logprobs"] = values

    def _chunk(self, choice: dict | None) -> dict:
        return {"id": self.id, "object": self.chunk_object_name, "created": self.created, "model": self.model,
                "choices": [] if choice is None else [choice]}

    def _delta_choice(self, delta: Delta, finish_reason: str | None, index: int) -> dict:
        raise NotImplementedError

    def _full_choice(self, choice: Choice, index: int) -> dict:
        raise NotImplementedError


class CompletionShape(ResponseShape):
    id_prefix = "cmpl"
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(self, model: str, tokenizer: Any = None):
        super().__init__(model, tokenizer)
        self._offsets: dict[int, int] = {}  # choice index -> text offset of its next streamed token

    def _delta_choice(self, delta: Delta, finish_reason: str | None, index: int) -> dict:
        logprobs = None
        if delta.logprobs:
            logprobs, self._offsets[index] = completion_logprobs(self._text_of, delta.logprobs,
                                                                 self._offsets.get(index, 0))
        return {"index": index, "text": delta.text, "logprobs": logprobs, "finish_reason": finish_reason}

    def _full_choice(self, choice: Choice, index: int) -> dict:
        logprobs = None if choice.logprobs is None else completion_logprobs(self._text_of, choice.logprobs, 0)[0]
        return {"index": index, "text": choice.text, "logprobs": logprobs, "finish_reason": choice.finish_reason}


class ChatShape(ResponseShape):
    id_prefix = "chatcmpl"
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def opening_frames(self, index: int = 0) -> list[bytes]:
        return [sse(self._chunk({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}))]

    def _delta_choice(self, delta: Delta, finish_reason: str | None, index: int) -> dict:
        body: dict[str, Any] = {"content": delta.text} if finish_reason is None else {}
        if delta.tool_calls:
            body = {**({"content": delta.text} if delta.text else {}),
                    "tool_calls": [call.body(i) for i, call in enumerate(delta.tool_calls)]}
        logprobs = {"content": chat_content(self._text_of, delta.logprobs), "refusal": None} if delta.logprobs \
            else None
        return {"index": index, "delta": body, "logprobs": logprobs, "finish_reason": finish_reason}

    def _full_choice(self, choice: Choice, index: int) -> dict:
        logprobs = None if choice.logprobs is None else \
            {"content": chat_content(self._text_of, choice.logprobs), "refusal": None}
        message: dict[str, Any] = {"role": "assistant", "content": choice.text}
        if choice.tool_calls:
            message = {"role": "assistant", "content": choice.text or None,
                       "tool_calls": [call.body() for call in choice.tool_calls]}
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": choice.finish_reason}

    def _add_token_ids(self, body: dict, choice: dict, token_ids: TokenIds) -> None:
        body["prompt_token_ids"], choice["token_ids"] = list(token_ids.prompt), list(token_ids.output)

    def _add_prompt_logprobs(self, body: dict, choice: dict, values: list) -> None:
        body["prompt_logprobs"] = values


SHAPES: dict[Endpoint, type[ResponseShape]] = {Endpoint.COMPLETION: CompletionShape, Endpoint.CHAT: ChatShape}
