"""Structured outputs in the OpenAI API: the request fields that constrain the output to a grammar, each
read into a `GrammarSpec` and checked before any worker sees it (a grammar that does not parse is a
400 naming its field).

    response_format   {"type": "text"} | {"type": "json_object"} |
                      {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}   (OpenAI)
    structured_outputs {"json": schema} | {"regex": str} | {"choice": [str]} | {"grammar": EBNF} |
                      {"json_object": true}                                               (vLLM's)
    guided_json, guided_regex, guided_choice, guided_grammar                               (vLLM's older names)

At most one of them per request. JSON is emitted compactly (`common.grammar_spec.JSON_SEPARATORS`).
The check parses the grammar with xgrammar on a thread (its import, on the first structured request,
takes seconds and brings torch into the gateway's process: hundreds of MB, paid only by servers that get
such requests); checked grammars are remembered.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

import anyio

from common.grammar_spec import GrammarError, GrammarSpec, grammar_of
from router.gateway.errors import invalid

CHECKED_GRAMMARS = 256
"""Grammars whose check is remembered (the last ones seen)."""
_LEGACY = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_checked: OrderedDict[GrammarSpec, str] = OrderedDict()  # spec -> "" (parses) or why not


def grammar_field(payload: dict) -> tuple[GrammarSpec | None, str]:
    """(the request's grammar or None, the field it came from)."""
    asked = [name for name in ("response_format", "structured_outputs", *_LEGACY) if payload.get(name) is not None]
    if isinstance(payload.get("response_format"), dict) and payload["response_format"].get("type") == "text":
        asked.remove("response_format")  # plain text: no grammar
    if len(asked) > 1:
        raise invalid(f"at most one of {', '.join(asked)} may be given", param=asked[1])
    if not asked:
        _response_format(payload.get("response_format"))  # a well-formed "text", or absent
        return None, ""
    name = asked[0]
    if name == "response_format":
        return _response_format(payload[name]), "response_format"
    if name == "structured_outputs":
        return _structured_outputs(payload[name]), "structured_outputs"
    return _spec(_LEGACY[name], payload[name], name), name


async def check_grammar(spec: GrammarSpec, param: str) -> None:
    """400 naming `param` when `spec` does not parse; parsed on a thread, the loop never waits."""
    error = _checked.get(spec)
    if error is None:
        error = await anyio.to_thread.run_sync(_parse, spec)
        _checked[spec] = error
        while len(_checked) > CHECKED_GRAMMARS:
            _checked.popitem(last=False)
    else:
        _checked.move_to_end(spec)
    if error:
        raise invalid(f"`{param}`: {error}", param=param, code="invalid_grammar")


def _parse(spec: GrammarSpec) -> str:
    try:
        grammar_of(spec)
    except GrammarError as exc:
        return str(exc)
    return ""


def _response_format(value: Any) -> GrammarSpec | None:
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise invalid("`response_format.type` must be one of text, json_object, json_schema",
                      param="response_format.type")
    if value["type"] == "text":
        return None
    if value["type"] == "json_object":
        return GrammarSpec.json_object()
    schema = value.get("json_schema")
    if not isinstance(schema, dict) or not isinstance(schema.get("name"), str):
        raise invalid("`response_format.json_schema` must be an object with a `name` and a `schema`",
                      param="response_format.json_schema")
    strict = schema.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid("`response_format.json_schema.strict` must be a boolean",
                      param="response_format.json_schema.strict")
    body = schema.get("schema", {})
    if not isinstance(body, (dict, bool)):
        raise invalid("`response_format.json_schema.schema` must be a JSON schema (an object)",
                      param="response_format.json_schema.schema")
    return GrammarSpec.json_schema(body, strict=bool(strict))


def _structured_outputs(value: Any) -> GrammarSpec:
    if not isinstance(value, dict):
        raise invalid("`structured_outputs` must be an object", param="structured_outputs")
    kinds = [k for k in ("json", "regex", "choice", "grammar", "json_object") if value.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise invalid("`structured_outputs` takes exactly one of json, regex, choice, grammar, json_object",
                      param="structured_outputs")
    if kinds[0] == "json_object":
        if value["json_object"] is not True:
            raise invalid("`structured_outputs.json_object` must be true", param="structured_outputs.json_object")
        return GrammarSpec.json_object()
    return _spec(kinds[0], value[kinds[0]], f"structured_outputs.{kinds[0]}")


def _spec(kind: str, value: Any, param: str) -> GrammarSpec:
    try:
        if kind == "json":
            if isinstance(value, str):
                value = json.loads(value)
            if not isinstance(value, (dict, bool)):
                raise GrammarError("a JSON schema is an object")
            return GrammarSpec.json_schema(value)
        if kind == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
                raise GrammarError("a choice is a non-empty list of strings")
            return GrammarSpec.choice(value)
        if not isinstance(value, str) or not value:
            raise GrammarError(f"a {kind} is a non-empty string")
        return GrammarSpec.regex(value) if kind == "regex" else GrammarSpec.grammar(value)
    except (GrammarError, json.JSONDecodeError) as exc:
        raise invalid(f"`{param}`: {exc}", param=param) from None
