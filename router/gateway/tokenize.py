"""`POST /tokenize` and `POST /detokenize` (vLLM's): the served model's tokenizer over HTTP, as the
generation endpoints use it, behind the same API key and body limits.

    /tokenize    {"prompt": "..."} (or token ids) as /v1/completions encodes it, or {"messages": [...]}
                 through the chat template as /v1/chat/completions renders it
                 -> {"count": n, "max_model_len": L, "tokens": [ids]}
    /detokenize  {"tokens": [ids]} -> {"prompt": text} (special tokens kept: the ids' own text)
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request

from router.gateway.errors import APIError, invalid
from router.gateway.json_body import check_json_content_type, int_list_field, parse_json_object
from router.gateway.schema import prompt_ids_of


class TokenizeResponse(BaseModel):
    count: int = Field(ge=0)
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


def tokenize_request_models(limits: Any) -> dict[str, type[BaseModel]]:
    """The request bodies, by path, for the OpenAPI document (described, not validated: see `openapi`)."""
    TokenId = Annotated[int, Field(ge=0, lt=limits.vocab_size)]  # noqa: N806

    class TokenizeRequest(BaseModel):
        model_config = ConfigDict(extra="allow")
        prompt: str | Annotated[list[TokenId], Field(min_length=1)] | None = None  # "" counts 0 tokens
        messages: list[dict[str, Any]] | None = Field(None, description="Instead of `prompt`: chat messages.")

    class DetokenizeRequest(BaseModel):
        model_config = ConfigDict(extra="allow")
        tokens: list[TokenId]

    return {"/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}


async def tokenize(gateway: Any, request: Request) -> Response:
    try:
        payload = await _body(gateway, request)
        if "messages" not in payload and payload.get("prompt") is None:
            raise invalid("`prompt` or `messages` is required", param="prompt", code="missing_parameter")
        ids = prompt_ids_of(payload, gateway.backend.tokenizer, gateway.limits.vocab_size)
        return JSONResponse({"count": len(ids), "max_model_len": gateway.limits.max_model_len, "tokens": ids})
    except APIError as err:
        return err.response()


async def detokenize(gateway: Any, request: Request) -> Response:
    try:
        payload = await _body(gateway, request)
        if payload.get("tokens") is None:
            raise invalid("`tokens` is required", param="tokens", code="missing_parameter")
        ids = int_list_field(payload, "tokens")
        if not all(0 <= t < gateway.limits.vocab_size for t in ids):
            raise invalid(f"`tokens` must be token ids in [0, {gateway.limits.vocab_size})", param="tokens")
        return JSONResponse({"prompt": gateway.backend.tokenizer.decode(ids)})
    except APIError as err:
        return err.response()


async def _body(gateway: Any, request: Request) -> dict:
    gateway.check_api_key(request)
    check_json_content_type(request)
    return parse_json_object(await gateway.read_body(request))
