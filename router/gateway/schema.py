"""OpenAI request bodies -> `GenerateRequest` (prompt token ids + `SamplingParams`), or `APIError`.

Parsing is by hand rather than by pydantic models so that each error names its `param` and has the
status the OpenAI API gives it. Unknown fields are ignored; known fields that would change what the
model is asked to do and that tandem cannot honour (tools, suffix, best_of > 1, ...) are rejected
with 400 rather than silently dropped. The body as JSON, and typed reads of its fields, each
failure naming its param: `router.gateway.json_body`.

Streaming sessions: a generation body may name `session_id`; it then carries only the new turn, and
the parser is given the session's `history` to put before it (token ids for a completion, messages
for a chat), so every length limit applies to the whole conversation.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from common.config import (
    MAX_CHOICES,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SEED_MAX,
    SEED_MIN,
    ConfigError,
    SamplingDefaults,
    SamplingParams,
)
from kernels.model.tokenizer import encode_prompt
from router.gateway.errors import APIError, invalid
from router.gateway.json_body import as_int, as_ints, int_list_field, integer_field, number_field, typed_field
from router.gateway.logit_fields import logit_fields
from router.gateway.logprobs import LogprobAsk, chat_fields, completion_fields
from router.gateway.messages import chat_prompt, unsupported
from router.gateway.structured import grammar_field
from router.gateway.tools import ToolAsk, forced_grammar, tools_field

DEFAULT_SESSION_IDLE_TIMEOUT_S = 300.0
MAX_SESSION_IDLE_TIMEOUT_S = 3600.0
MAX_SESSION_ID_CHARS = 128


class Endpoint(enum.Enum):
    COMPLETION = "completion"
    CHAT = "chat"


@dataclass(frozen=True)
class ModelLimits:
    """What validation needs to know about the served model."""

    served_name: str
    max_model_len: int  # prompt + completion tokens at most
    vocab_size: int  # prompt token ids must lie in [0, vocab_size)
    default_max_tokens: int  # when the request names none (capped by the context left)
    max_prompt_tokens: int | None  # None: only max_model_len limits the prompt
    sampling: SamplingDefaults = SamplingDefaults()  # what unset sampling fields become
    tool_parser: str = "hermes"  # how tool calls are read from the output (`router.gateway.tool_parsers`)


@dataclass(frozen=True)
class GenerateRequest:
    endpoint: Endpoint
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool  # stream_options.include_usage: a final usage chunk when streaming
    session_id: str = ""  # a turn of this streaming session ("": a plain request)
    messages: tuple[dict[str, str], ...] = ()  # chat: the conversation the prompt renders (history included)
    return_token_ids: bool = False  # the response names the prompt's and the output's token ids (vLLM's field)
    n: int = 1  # choices: sibling requests over the same prompt (`router.gateway.siblings`)
    follow: str = ""  # a sibling choice: the id of choice 0's request, whose decode worker it joins
    more_prompts: tuple[list[int], ...] = ()  # a completion's further prompts (a batch): n choices each
    ask: LogprobAsk = LogprobAsk()  # a completion's echo (`router.gateway.logprobs`)
    grammar_param: str = ""  # the field `params.grammar` came from (`router.gateway.structured`)
    tools: ToolAsk | None = None  # a chat's tools, unless none or tool_choice "none" (`router.gateway.tools`)

    @property
    def prompts(self) -> tuple[list[int], ...]:
        return (self.prompt_token_ids, *self.more_prompts)


@dataclass(frozen=True)
class SessionRequest:
    """A POST /v1/sessions body."""

    capacity_tokens: int  # the whole conversation (history + one turn's prompt and completion), at most
    idle_timeout_s: float  # closed when idle this long between turns


def parse_completion(payload: dict, tokenizer: Any, limits: ModelLimits,
                     history: Sequence[int] = ()) -> GenerateRequest:
    """A /v1/completions body. The prompt is encoded without a chat template or special tokens, and
    follows `history` (a session's token ids so far)."""
    _check_common(payload, limits)
    _check_off(payload, "suffix", "")
    _check_off(payload, "best_of", 1, "best_of > 1")
    fields, ask = completion_fields(payload)
    grammar_param = _grammar(payload, fields)
    if ask.prompt_only:
        payload = {**payload, "max_tokens": 1}
    prompts = [[*history, *p] for p in _completion_prompts(payload, tokenizer, limits.vocab_size)]
    if not all(prompts):
        raise invalid("the prompt is empty", param="prompt")
    if len(prompts) > 1 and history:
        raise unsupported("prompt", "more than one prompt in a session turn")
    if session_id_of(payload) and (ask.echo or "prompt_logprobs" in fields):
        raise unsupported("echo" if ask.echo else "prompt_logprobs", "the prompt's logprobs in a session turn")
    longest = max(prompts, key=len)
    parsed = _request(Endpoint.COMPLETION, payload, longest, _budget(payload, len(longest), limits), limits, fields)
    if parsed.n * len(prompts) > MAX_CHOICES:
        raise invalid(f"n x the prompts is at most {MAX_CHOICES} choices, got {parsed.n} x {len(prompts)}", param="n")
    return replace(parsed, prompt_token_ids=prompts[0], more_prompts=tuple(prompts[1:]), ask=ask,
                   grammar_param=grammar_param)


def parse_chat(payload: dict, tokenizer: Any, limits: ModelLimits,
               history: Sequence[dict[str, str]] = ()) -> GenerateRequest:
    """A /v1/chat/completions body. `history` (a session's messages so far) and the messages go
    through the model's chat template together."""
    _check_common(payload, limits)
    fields = chat_fields(payload)
    grammar_param = _grammar(payload, fields)
    if session_id_of(payload) and "prompt_logprobs" in fields:
        raise unsupported("prompt_logprobs", "the prompt's logprobs in a session turn")
    _check_off(payload, "functions", [])
    _check_off(payload, "function_call", "none")
    tools = tools_field(payload, limits.tool_parser)
    if tools is not None and tools.forced:
        if grammar_param or as_int(payload.get("min_tokens")):
            clash = grammar_param or "min_tokens"
            raise unsupported(clash, f"{clash} with a tool_choice that forces a call")
        fields["grammar"], grammar_param = forced_grammar(tools), "tool_choice"
    messages, prompt_ids = chat_prompt(payload, tokenizer, history, tools)
    max_tokens = _budget(payload, len(prompt_ids), limits)
    return replace(_request(Endpoint.CHAT, payload, prompt_ids, max_tokens, limits, fields), messages=messages,
                   grammar_param=grammar_param, tools=tools)


def _grammar(payload: dict, fields: dict[str, Any]) -> str:
    """Put the request's grammar (if any) in `fields`; the field it came from."""
    spec, param = grammar_field(payload)
    if spec is not None:
        if as_int(payload.get("min_tokens")):
            raise unsupported("min_tokens", f"min_tokens with {param} (the grammar decides where the output ends)")
        fields["grammar"] = spec
    return param


def _budget(payload: dict, prompt_len: int, limits: ModelLimits) -> int:
    """`max_completion_tokens` where given (it wins; `max_tokens` must still be well-formed), else `max_tokens`."""
    if payload.get("max_completion_tokens") is not None:
        _max_tokens(payload, "max_tokens", prompt_len, limits)
        return _max_tokens(payload, "max_completion_tokens", prompt_len, limits)
    return _max_tokens(payload, "max_tokens", prompt_len, limits)


def session_id_of(payload: dict) -> str:
    """The `session_id` extension field of a generation body; "" when absent (or null)."""
    session_id = typed_field(payload, "session_id", str)
    if session_id is None:
        return ""
    if not 0 < len(session_id) <= MAX_SESSION_ID_CHARS:
        raise invalid(f"`session_id` must be a non-empty string of at most {MAX_SESSION_ID_CHARS} characters",
                      param="session_id")
    return session_id


def parse_session(payload: dict, limits: ModelLimits) -> SessionRequest:
    """A POST /v1/sessions body: `capacity_tokens` in [1, max_model_len] (default max_model_len),
    `idle_timeout_s` in (0, MAX_SESSION_IDLE_TIMEOUT_S] (default DEFAULT_SESSION_IDLE_TIMEOUT_S)."""
    capacity = integer_field(payload, "capacity_tokens")
    if capacity is not None and not 1 <= capacity <= limits.max_model_len:
        raise invalid(f"`capacity_tokens` must be an integer in [1, {limits.max_model_len}] (the context length), "
                      f"got {capacity}", param="capacity_tokens")
    idle_timeout_s = number_field(payload, "idle_timeout_s")
    if idle_timeout_s is not None and not 0 < idle_timeout_s <= MAX_SESSION_IDLE_TIMEOUT_S:
        raise invalid(f"`idle_timeout_s` must be a number in (0, {MAX_SESSION_IDLE_TIMEOUT_S:g}], "
                      f"got {idle_timeout_s}", param="idle_timeout_s")
    return SessionRequest(limits.max_model_len if capacity is None else capacity,
                          DEFAULT_SESSION_IDLE_TIMEOUT_S if idle_timeout_s is None else float(idle_timeout_s))


# ---- shared checks ------------------------------------------------------------------------------
def _check_common(payload: dict, limits: ModelLimits) -> None:
    model = payload.get("model")
    if model is not None and model != limits.served_name:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {limits.served_name!r}",
                       code="model_not_found", param="model")
    typed_field(payload, "user", str)  # ignored, but documented as a string


def _check_off(payload: dict, name: str, off: Any, what: str | None = None) -> None:
    """A field tandem cannot honour is accepted only absent, null, or at the one value meaning "off"
    (of that value's JSON type: `0` is not `false`, `""` is not `[]`); 400 otherwise."""
    value = payload.get(name)
    if value is None:
        return
    if isinstance(off, bool):
        is_off = value is off
    elif isinstance(off, int):
        is_off = as_int(value) == off  # JSON Schema's integers: 1 and 1.0
    else:
        is_off = type(value) is type(off) and value == off
    if not is_off:
        raise unsupported(name, what)


def _request(endpoint: Endpoint, payload: dict, prompt_ids: list[int], max_tokens: int,
             limits: ModelLimits, logprob_fields: dict[str, Any]) -> GenerateRequest:
    stream = bool(typed_field(payload, "stream", bool))
    options = typed_field(payload, "stream_options", dict) or {}
    include_usage = options.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise invalid("`stream_options.include_usage` must be a boolean", param="stream_options.include_usage")
    return_token_ids = bool(typed_field(payload, "return_token_ids", bool))
    if return_token_ids and stream:
        raise unsupported("return_token_ids", "return_token_ids with stream (ask without streaming)")
    n = _bounded_integer(payload, "n", 1, MAX_CHOICES) or 1
    session_id = session_id_of(payload)
    if n > 1 and session_id:
        raise unsupported("n", "n > 1 in a session turn (a session continues one conversation)")
    return GenerateRequest(endpoint, prompt_ids, _sampling_params(payload, max_tokens, limits, logprob_fields), stream,
                           bool(include_usage), session_id, return_token_ids=return_token_ids, n=n)


def _sampling_params(payload: dict, max_tokens: int, limits: ModelLimits, extra: dict[str, Any]) -> SamplingParams:
    """Every sampling field checked here, each error naming its param; SamplingParams re-checks.
    Unset temperature, top_p and top_k come from `limits.sampling`."""
    vocab_size, defaults = limits.vocab_size, limits.sampling
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=_temperature(payload, defaults.temperature),
            top_p=_top_p(payload, defaults.top_p),
            top_k=_top_k(payload, vocab_size, defaults.top_k),
            seed=_bounded_integer(payload, "seed", SEED_MIN, SEED_MAX),
            stop=_stop_strings(payload),
            stop_token_ids=_stop_token_ids(payload, vocab_size),
            ignore_eos=bool(typed_field(payload, "ignore_eos", bool)),
            **logit_fields(payload, vocab_size, max_tokens), **extra)
    except ConfigError as exc:
        raise invalid(str(exc)) from None


def _temperature(payload: dict, default: float) -> float:
    temperature = number_field(payload, "temperature")
    if temperature is not None and temperature < 0:
        raise invalid(f"temperature must be >= 0, got {temperature}", param="temperature")
    return default if temperature is None else float(temperature)


def _top_p(payload: dict, default: float) -> float:
    top_p = number_field(payload, "top_p")
    if top_p is not None and not 0 < top_p <= 1:
        raise invalid(f"top_p must be in (0, 1], got {top_p}", param="top_p")
    return default if top_p is None else float(top_p)


def _top_k(payload: dict, vocab_size: int, default: int) -> int:
    """The engine's top_k: 0 is off. OpenAI-style clients say -1 for off; a top_k of the vocabulary
    or more keeps every token, which is off too (and never reaches a tensor as a huge integer)."""
    top_k = integer_field(payload, "top_k")
    if top_k is not None and top_k < -1:
        raise invalid(f"top_k must be -1 or 0 (disabled) or a positive integer, got {top_k}", param="top_k")
    if top_k is None:
        top_k = default
    return 0 if top_k <= 0 or top_k >= vocab_size else top_k


def _bounded_integer(payload: dict, name: str, low: int, high: int) -> int | None:
    value = integer_field(payload, name)
    if value is not None and not low <= value <= high:
        raise invalid(f"`{name}` must be an integer in [{low}, {high}], got {value}", param=name)
    return value


def _stop_token_ids(payload: dict, vocab_size: int) -> tuple[int, ...]:
    ids = int_list_field(payload, "stop_token_ids")
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise invalid(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed, got {len(ids)}",
                      param="stop_token_ids")
    if not all(0 <= t < vocab_size for t in ids):
        raise invalid(f"stop_token_ids must be in [0, {vocab_size})", param="stop_token_ids")
    return tuple(ids)


def _stop_strings(payload: dict) -> tuple[str, ...]:
    stop = payload.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise invalid("`stop` must be a non-empty string or a list of non-empty strings", param="stop")
    if len(stop) > MAX_STOP_STRINGS:  # every new token is checked against each of them
        raise invalid(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stop)}", param="stop")
    total_chars = sum(map(len, stop))
    if total_chars > MAX_STOP_CHARS:
        raise invalid(f"the stop strings may have {MAX_STOP_CHARS} characters together at most, got {total_chars}",
                      param="stop")
    return tuple(stop)


def _max_tokens(payload: dict, name: str, prompt_len: int, limits: ModelLimits) -> int:
    """The completion budget: as asked, or min(default, context left). Checks every length limit."""
    if prompt_len == 0:
        raise invalid("the prompt is empty", param="messages" if "messages" in payload else "prompt")
    if limits.max_prompt_tokens is not None and prompt_len > limits.max_prompt_tokens:
        raise invalid(f"the prompt has {prompt_len} tokens; this server accepts at most "
                      f"{limits.max_prompt_tokens}", code="prompt_too_long")
    asked = integer_field(payload, name)
    if asked is not None and asked <= 0:
        raise invalid(f"{name} must be >= 1, got {asked}", param=name)
    context_left = limits.max_model_len - prompt_len
    if context_left <= 0:
        raise invalid(f"this model's maximum context length is {limits.max_model_len} tokens; the prompt alone "
                      f"has {prompt_len}", param="messages" if "messages" in payload else "prompt",
                      code="context_length_exceeded")
    max_tokens = asked if asked is not None else min(limits.default_max_tokens, context_left)
    if prompt_len + max_tokens > limits.max_model_len:
        raise invalid(f"this model's maximum context length is {limits.max_model_len} tokens; the prompt has "
                      f"{prompt_len} and {max_tokens} completion tokens were requested",
                      param=name, code="context_length_exceeded")
    return max_tokens


# ---- prompts ------------------------------------------------------------------------------------
def _completion_prompts(payload: dict, tokenizer: Any, vocab_size: int) -> list[list[int]]:
    """`prompt`: a string, a non-empty list of token ids, or a batch: a list of (at most `MAX_CHOICES`)
    strings or token-id lists."""
    prompt = payload.get("prompt")
    if prompt is None:
        raise invalid("`prompt` is required", param="prompt", code="missing_parameter")
    batch = prompt if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt) \
        else [prompt]
    if len(batch) > MAX_CHOICES:
        raise invalid(f"at most {MAX_CHOICES} prompts per request, got {len(batch)}", param="prompt")
    return [_one_prompt(p, tokenizer, vocab_size) for p in batch]


def _one_prompt(prompt: Any, tokenizer: Any, vocab_size: int) -> list[int]:
    if isinstance(prompt, str):
        return encode_prompt(tokenizer, prompt)
    token_ids = as_ints(prompt) if isinstance(prompt, list) and prompt else None
    if token_ids is not None:
        if not all(0 <= t < vocab_size for t in token_ids):
            raise invalid(f"prompt token ids must be in [0, {vocab_size})", param="prompt")
        return token_ids
    raise invalid("`prompt` must be a string, a non-empty list of token ids, or a list of those", param="prompt")


def prompt_ids_of(payload: dict, tokenizer: Any, vocab_size: int) -> list[int]:
    """A /tokenize body's token ids: its `messages` (and `tools`) through the chat template (with the
    assistant's turn opened, as a chat request renders them), else its `prompt` as a completion
    encodes it."""
    if "messages" in payload:
        return chat_prompt(payload, tokenizer, (), tools_field(payload, "hermes"))[1]  # rendering: any parser
    [ids] = _completion_prompts(payload, tokenizer, vocab_size) if not isinstance(payload.get("prompt"), list) \
        else [_one_prompt(payload["prompt"], tokenizer, vocab_size)]
    return ids
