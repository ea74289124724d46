"""The gateway's OpenAPI document (`GET /openapi.json`): every endpoint's request body, responses and
error shape, as pydantic models.

The models describe; they do not validate. Requests are still parsed by hand (`schema.py`) so that
each error names its `param`; a test fuzzes the server from this document (schemathesis), so the two
must agree. Request models are built per app (`request_models`): the served model's name, its
context length and vocabulary bound fields that a static schema could not.

What the document does not capture: a prompt's token count against the context (400
`context_length_exceeded`), `min_tokens` past the completion budget, `n` > 1 in a session turn, more
than 16 choices (n x the prompts), `max_tokens: 0` without `echo`, `top_logprobs` without
`logprobs: true`, the prompt's logprobs in a session turn, and completion-only values that mean
"off" (best_of, suffix are accepted only at their default).
"""

from __future__ import annotations

from importlib import metadata
from typing import Annotated, Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field

from common import config
from router.gateway import schema
from router.gateway.messages import CHAT_ROLES
from router.gateway.openapi_logprobs import ChatLogprobs, CompletionLogprobs, PromptLogprobs
from router.gateway.openapi_structured import ResponseFormat, StructuredOutputs
from router.gateway.openapi_tools import TextPart, ToolCallDelta, ToolCallItem, ToolChoice, ToolMessage, Tools
from router.gateway.schema import ModelLimits

SECURITY_SCHEME = "bearer"
_STATUS_WORDS = {400: "Invalid request", 401: "Missing or wrong API key", 403: "Host or Origin not served here",
                 404: "Unknown model or session", 408: "Body not received in time",
                 409: "A turn of this session is running", 413: "Body too large",
                 415: "Body not declared JSON", 429: "Too many requests; see Retry-After",
                 500: "Internal error (the message carries an error id)",
                 503: "Unavailable or draining; see Retry-After"}


# ---- responses ----------------------------------------------------------------------------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error, whatever its status (errors.py)."""

    error: ErrorDetail


class CachedTokensDetails(BaseModel):
    """Where the cached prompt tokens were found at admission (SGLang's split)."""

    device: int = Field(ge=0)
    host: int = Field(ge=0)
    l3: int = Field(ge=0)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(ge=0)
    cached_tokens_details: CachedTokensDetails | None = None


class Usage(BaseModel):
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=0)
    prompt_tokens_details: PromptTokensDetails


FinishReason = Literal["stop", "length", "tool_calls"]


class CompletionChoice(BaseModel):
    index: int = Field(ge=0, lt=config.MAX_CHOICES, description="The choice (of `n`).")
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason
    prompt_logprobs: PromptLogprobs | None = Field(None, description="With prompt_logprobs (vLLM's).")
    prompt_token_ids: list[int] | None = Field(None, description="With return_token_ids: the prompt's token ids.")
    token_ids: list[int] | None = Field(None, description="With return_token_ids: every output token id.")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice] = Field(min_length=1, max_length=config.MAX_CHOICES)
    usage: Usage


class ChatMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None = Field(description="Null when the answer is tool calls alone.")
    tool_calls: list[ToolCallItem] | None = None


class ChatChoice(BaseModel):
    index: int = Field(ge=0, lt=config.MAX_CHOICES, description="The choice (of `n`).")
    message: ChatMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason
    token_ids: list[int] | None = Field(None, description="With return_token_ids: every output token id.")


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice] = Field(min_length=1, max_length=config.MAX_CHOICES)
    usage: Usage
    prompt_token_ids: list[int] | None = Field(None, description="With return_token_ids: the rendered prompt's "
                                                                 "token ids.")
    prompt_logprobs: PromptLogprobs | None = Field(None, description="With prompt_logprobs (vLLM's).")


class CompletionChunkChoice(BaseModel):
    index: int = Field(ge=0, lt=config.MAX_CHOICES, description="The choice (of `n`).")
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None


class CompletionChunk(BaseModel):
    """One `data:` frame of a streamed completion (the usage frame has no choices)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice] = Field(max_length=1)
    usage: Usage | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int = Field(ge=0, lt=config.MAX_CHOICES, description="The choice (of `n`).")
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletionChunk(BaseModel):
    """One `data:` frame of a streamed chat completion (the usage frame has no choices)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice] = Field(max_length=1)
    usage: Usage | None = None


class GenerationDefaults(BaseModel):
    """What a request's unset sampling fields become (`gateway.generation_config`)."""
    temperature: float
    top_p: float
    top_k: int
    source: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    generation_defaults: GenerationDefaults


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class HealthStatus(BaseModel):
    status: Literal["ok"]


class ReadyStatus(BaseModel):
    status: Literal["ready"]


class WorkerList(BaseModel):
    workers: list[dict[str, Any]]


class SessionObject(BaseModel):
    """An open streaming session (POST /v1/sessions)."""

    id: str
    object: Literal["session"]
    capacity_tokens: int = Field(ge=1)
    idle_timeout_s: float = Field(gt=0)


class SessionDeleted(BaseModel):
    id: str
    object: Literal["session.deleted"]
    deleted: Literal[True]


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` entries for error statuses, all in the one error shape."""
    return {status: {"model": ErrorResponse, "description": _STATUS_WORDS[status]} for status in statuses}


GENERATION_ERRORS = errors(400, 401, 403, 404, 408, 409, 413, 415, 429, 500, 503)


def generation_responses(body: type[BaseModel], chunk: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    sse = (f"With `stream: true`: server-sent events, each `data: <{chunk.__name__}>` (see the "
           f"component), an `ErrorResponse` frame if the request fails after its first frame, then "
           "`data: [DONE]`.")
    return {200: {"model": body, "description": f"The whole answer ({body.__name__}). {sse}",
                  "content": {"text/event-stream": {"schema": SSE_EVENT}}},
            **GENERATION_ERRORS}


SSE_EVENT = {  # one event (Open API 3.1: an event-stream's schema describes each event)
    "type": "object", "required": ["data"],
    "properties": {"event": {"const": "message"},
                   "data": {"type": "string", "contentMediaType": "application/json",
                            "description": "A chunk, an ErrorResponse, or the final `[DONE]`."}}}


# ---- requests -----------------------------------------------------------------------------------
class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool | None = None


NonEmptyString = Annotated[str, Field(min_length=1)]
StopString = NonEmptyString


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal[tuple(sorted(CHAT_ROLES - {"assistant", "tool"}))]  # type: ignore[valid-type]
    content: str | list[TextPart] = Field(description="Text, or text parts joined by newlines.")


class AssistantInputMessage(BaseModel):
    """An earlier answer of the assistant; its content may be null (an empty turn)."""

    model_config = ConfigDict(extra="allow")
    role: Literal["assistant"]
    content: str | list[TextPart] | None
    tool_calls: list[ToolCallItem] | None = None


def request_models(limits: ModelLimits) -> tuple[type[BaseModel], type[BaseModel]]:
    """(CompletionRequest, ChatCompletionRequest) bounded by this app's model. Unknown fields are
    allowed (and ignored), as by the parser; fields left out take the defaults in their descriptions."""
    ModelName = Literal[limits.served_name]  # type: ignore[name-defined]  # noqa: N806 - one value, known at run time
    TokenId = Annotated[int, Field(ge=0, lt=limits.vocab_size)]  # noqa: N806
    MaxTokens = Annotated[int, Field(ge=1, le=limits.max_model_len)]  # noqa: N806
    Count = Annotated[int, Field(ge=0, le=config.MAX_LOGPROBS)]  # noqa: N806

    class SamplingFields(BaseModel):
        model_config = ConfigDict(extra="allow")
        model: ModelName | None = Field(None, description="The served model; other names get 404.")
        max_tokens: MaxTokens | None = Field(None, description="Completion tokens at most; default: "
                                              "gateway.default_max_tokens, capped by the context left.")
        temperature: float | None = Field(None, ge=0, description="Default 1; 0 is greedy.")
        top_p: float | None = Field(None, gt=0, le=1)
        top_k: int | None = Field(None, ge=-1, description="-1 or 0: off; the vocabulary size or more: off.")
        seed: int | None = Field(None, ge=config.SEED_MIN, le=config.SEED_MAX)
        stop: StopString | Annotated[list[StopString], Field(max_length=config.MAX_STOP_STRINGS)] | None = Field(
            None, description="Stop strings (4096 characters together at most); the text ends before the first.")
        stop_token_ids: Annotated[list[TokenId], Field(max_length=config.MAX_STOP_TOKEN_IDS)] | None = None
        ignore_eos: bool | None = None
        return_token_ids: bool | None = Field(None, description="Extension (vLLM's): the response names the "
                                              "prompt's and the output's token ids. Not with stream.")
        stream: bool | None = None
        stream_options: StreamOptions | None = None
        n: int | None = Field(None, ge=1, le=config.MAX_CHOICES, description="Choices: siblings over one prompt, "
                              "seeded apart (choice i of seed s: a seed of its own, the same on every repeat).")
        max_completion_tokens: MaxTokens | None = Field(None, description="Wins over max_tokens.")
        presence_penalty: float | None = Field(None, ge=-2, le=2, description="Subtracted from the logit of "
                                               "each token the output holds.")
        frequency_penalty: float | None = Field(None, ge=-2, le=2, description="Subtracted from a token's "
                                                "logit once per time the output holds it.")
        repetition_penalty: float | None = Field(None, gt=0, description="Extension (vLLM's, HF's): the logits "
                                                 "of prompt and output tokens divided by it (1: off).")
        logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]],
                              Field(max_length=config.MAX_LOGIT_BIAS)] | None = Field(
            None, description="Token id (a string) -> a bias added to its logit.")
        min_p: float | None = Field(None, ge=0, le=1, description="Extension: after temperature, drop tokens "
                                    "below min_p x the top token's probability.")
        min_tokens: int | None = Field(None, ge=0, description="Extension: EOS and stop_token_ids cannot end "
                                       "the output before this many tokens.")
        prompt_logprobs: Count | None = Field(None, description="Extension (vLLM's): each prompt token's logprob, "
                                              "rank and the k best (the prompt is computed whole). Not in a session.")
        response_format: ResponseFormat | None = Field(None, description="json_object or json_schema: the output "
                                                       "is sampled within it (compact JSON). Not with min_tokens.")
        structured_outputs: StructuredOutputs | None = None
        user: str | None = Field(None, description="Accepted and ignored.")
        session_id: Annotated[str, Field(min_length=1, max_length=schema.MAX_SESSION_ID_CHARS)] | None = Field(
            None, description="Extension: a turn of this streaming session (POST /v1/sessions). The body then "
                              "carries only the new turn: its prompt (messages) follows the session's history. "
                              "Unknown or expired: 404; another turn of it running: 409.")

    class CompletionRequest(SamplingFields):
        prompt: (NonEmptyString | Annotated[list[TokenId], Field(min_length=1)]
                 | Annotated[list[NonEmptyString], Field(min_length=1, max_length=config.MAX_CHOICES)]
                 | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1,
                                                                                          max_length=config.MAX_CHOICES)]
                 ) = Field(
            description="A string or token ids, or a batch of them (n choices each; n x prompts <= 16).")
        max_tokens: Annotated[int, Field(ge=0, le=limits.max_model_len)] | None = Field(
            None, description="Completion tokens at most (0: with echo, the prompt scored alone); default: "
                              "gateway.default_max_tokens, capped by the context left.")
        echo: bool | None = Field(None,
                                  description="The prompt's text first (and its tokens' logprobs, with logprobs).")
        suffix: Literal[""] | None = None
        best_of: Literal[1] | None = None
        logprobs: Count | None = Field(None, description="Each token's logprob and the k best (raw log-softmax).")

    class ChatCompletionRequest(SamplingFields):
        messages: list[Annotated[InputMessage | AssistantInputMessage | ToolMessage, Field(discriminator="role")]] = \
            Field(min_length=1)
        logprobs: bool | None = Field(None, description="Each output token's logprob (raw log-softmax).")
        top_logprobs: Count | None = Field(None, description="With logprobs: the k best tokens at each position.")
        tools: Tools | None = None
        tool_choice: ToolChoice | None = Field(None, description="Default auto with tools. required and a named "
                                               "function are enforced by a grammar. Not with response_format.")
        parallel_tool_calls: bool | None = Field(None, description="Default true.")
        functions: Annotated[list[Any], Field(max_length=0)] | None = None

    CompletionRequest.__name__ = CompletionRequest.__qualname__ = "CompletionRequest"
    ChatCompletionRequest.__name__ = ChatCompletionRequest.__qualname__ = "ChatCompletionRequest"
    return CompletionRequest, ChatCompletionRequest


def session_request_model(limits: ModelLimits) -> type[BaseModel]:
    """The POST /v1/sessions body, bounded by this app's context length."""

    class SessionCreateRequest(BaseModel):
        model_config = ConfigDict(extra="allow")
        capacity_tokens: Annotated[int, Field(ge=1, le=limits.max_model_len)] | None = Field(
            None, description="Tokens the whole conversation may hold (history + one turn's prompt and "
                              "completion); reserved on a worker while the session is open. Default: the "
                              "context length.")
        idle_timeout_s: Annotated[float, Field(gt=0, le=schema.MAX_SESSION_IDLE_TIMEOUT_S)] | None = Field(
            None, description=f"Closed when idle this long between turns (then 404). Default "
                              f"{schema.DEFAULT_SESSION_IDLE_TIMEOUT_S:g}.")

    SessionCreateRequest.__name__ = SessionCreateRequest.__qualname__ = "SessionCreateRequest"
    return SessionCreateRequest


# ---- the document -------------------------------------------------------------------------------
def openapi_document(app: FastAPI, limits: ModelLimits, api_key_required: bool,
                     request_bodies: dict[str, type[BaseModel]]) -> dict[str, Any]:
    """The document for `app`: FastAPI's (paths, responses) plus the request bodies of the POST
    paths in `request_bodies` and, when a key is required, the bearer scheme on the guarded paths."""
    doc = get_openapi(title="tandem", version=_version(), routes=app.routes,
                      description="OpenAI-compatible LLM serving. Generation bodies must be JSON "
                                  "(Content-Type: application/json); the Host header must name this server.")
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for path, model in request_bodies.items():
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(body.pop("$defs", {}))
        schemas[model.__name__] = body
        doc["paths"][path]["post"]["requestBody"] = {
            "required": True, "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/"
                                                                                  f"{model.__name__}"}}}}
    for chunk in (CompletionChunk, ChatCompletionChunk):  # named by the SSE descriptions
        schema = chunk.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[chunk.__name__] = schema
    if api_key_required:
        doc["components"]["securitySchemes"] = {SECURITY_SCHEME: {"type": "http", "scheme": "bearer"}}
        for operations in doc["paths"].values():
            for operation in operations.values():
                if "401" in operation.get("responses", {}):
                    operation["security"] = [{SECURITY_SCHEME: []}]
    return doc


def _version() -> str:
    try:
        return metadata.version("tandem-serve")
    except metadata.PackageNotFoundError:
        return "0+unknown"
