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

from router.gateway.errors import APIError
from router.gateway.schema import Endpoint

SSE_DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    def body(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


@dataclass(frozen=True)
class TokenIds:
    """A request's prompt token ids (a session's history included) and every output token id."""

    prompt: tuple[int, ...]
    output: tuple[int, ...]


def sse(body: dict) -> bytes:
    return b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def sse_error(err: APIError) -> bytes:
    return sse(err.body())


class ResponseShape:
    """The bodies of one request's response; `id`, `created` and `model` are shared by all its frames."""

    id_prefix = ""
    object_name = ""
    chunk_object_name = ""

    def __init__(self, model: str):
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model

    def opening_frames(self, index: int = 0) -> list[bytes]:
        """Frames sent before the first token's text of choice `index`."""
        return []

    def delta_frame(self, text: str, index: int = 0) -> bytes:
        return sse(self._chunk(self._delta_choice(text, None, index)))

    def finish_frame(self, finish_reason: str, index: int = 0) -> bytes:
        return sse(self._chunk(self._delta_choice("", finish_reason, index)))

    def usage_frame(self, usage: Usage) -> bytes:
        return sse({**self._chunk(None), "choices": [], "usage": usage.body()})

    def full(self, text: str, finish_reason: str, usage: Usage, token_ids: TokenIds | None = None) -> dict:
        """The non-streaming response body; with `token_ids` (`return_token_ids`), the prompt's and the
        output's token ids where vLLM puts them."""
        return self.full_choices([(text, finish_reason, token_ids)], usage)

    def full_choices(self, choices: list[tuple[str, str, TokenIds | None]], usage: Usage) -> dict:
        """The body of a request with several choices (`n`): (text, finish_reason, token ids or None)
        each, in index order."""
        body = {"id": self.id, "object": self.object_name, "created": self.created, "model": self.model,
                "choices": [], "usage": usage.body()}
        for index, (text, finish_reason, token_ids) in enumerate(choices):
            choice = self._full_choice(text, finish_reason, index)
            body["choices"].append(choice)
            if token_ids is not None:
                self._add_token_ids(body, choice, token_ids)
        return body

    def _add_token_ids(self, body: dict, choice: dict, token_ids: TokenIds) -> None:
        choice["prompt_token_ids"], choice["token_ids"] = list(token_ids.prompt), list(token_ids.output)

    def _chunk(self, choice: dict | None) -> dict:
        return {"id": self.id, "object": self.chunk_object_name, "created": self.created, "model": self.model,
                "choices": [] if choice is None else [choice]}

    def _delta_choice(self, text: str, finish_reason: str | None, index: int) -> dict:
        raise NotImplementedError

    def _full_choice(self, text: str, finish_reason: str, index: int) -> dict:
        raise NotImplementedError


class CompletionShape(ResponseShape):
    id_prefix = "cmpl"
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def _delta_choice(self, text: str, finish_reason: str | None, index: int) -> dict:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def _full_choice(self, text: str, finish_reason: str, index: int) -> dict:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}


class ChatShape(ResponseShape):
    id_prefix = "chatcmpl"
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def opening_frames(self, index: int = 0) -> list[bytes]:
        return [sse(self._chunk({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}))]

    def _delta_choice(self, text: str, finish_reason: str | None, index: int) -> dict:
        delta = {"content": text} if finish_reason is None else {}
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}

    def _full_choice(self, text: str, finish_reason: str, index: int) -> dict:
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish_reason}

    def _add_token_ids(self, body: dict, choice: dict, token_ids: TokenIds) -> None:
        body["prompt_token_ids"], choice["token_ids"] = list(token_ids.prompt), list(token_ids.output)


SHAPES: dict[Endpoint, type[ResponseShape]] = {Endpoint.COMPLETION: CompletionShape, Endpoint.CHAT: ChatShape}
