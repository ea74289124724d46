"""A request body as a JSON object, and typed reads of its fields: every failure is a 400
(`APIError`) that names the offending `param`, so the gateway's parser (`router.gateway.schema`)
says only what each field means. A field that is absent or null reads as None (an empty list for
`int_list_field`); the caller picks the default.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from starlette.requests import Request

from router.gateway.errors import APIError, invalid


def parse_json_object(body: bytes) -> dict:
    """The body as a JSON object whose every string is valid Unicode, or 400."""
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise invalid(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(payload, dict):
        raise invalid("request body must be a JSON object", code="invalid_json")
    where = _lone_surrogate_at(payload)
    if where is not None:
        raise invalid(f"`{where or 'a key'}` is not valid Unicode: it holds a lone surrogate (\\ud800-\\udfff "
                      "escape without its pair)", param=where or None)
    return payload


_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate_at(payload: dict) -> str | None:
    """The param path (`messages[0].content`) of a string, or key, holding a lone surrogate;
    None when there is none. JSON's `\\ud800` escape yields such strings, which no tokenizer or
    UTF-8 encoder accepts. Iterative: the payload may be as deep as the JSON parser allows."""
    stack: list[tuple[str, Any]] = [("", payload)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                return path
        elif isinstance(value, dict):
            for key, item in value.items():
                if _SURROGATE.search(key):
                    return path  # the object holding the bad key ("" at the top level)
                stack.append((f"{path}.{key}" if path else key, item))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(value))
    return None


def typed_field(payload: dict, name: str, kind: type) -> Any:
    """The field as it is when it is a `kind`."""
    value = payload.get(name)
    if value is not None and not isinstance(value, kind):
        raise invalid(f"`{name}` must be a {kind.__name__}", param=name)
    return value


def number_field(payload: dict, name: str) -> float | None:
    """A finite number (JSON's 1e999 parses as infinity, and Python's JSON accepts NaN)."""
    value = payload.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise invalid(f"`{name}` must be a number", param=name)
    if isinstance(value, float) and not math.isfinite(value):
        raise invalid(f"`{name}` must be a finite number, got {value}", param=name)
    return value


def as_int(value: Any) -> int | None:
    """`value` as an int when JSON Schema calls it an integer (2, and 2.0: a number with no fraction);
    None for anything else (booleans included)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return None


def as_ints(values: list) -> list[int] | None:
    ints = [as_int(v) for v in values]
    return None if None in ints else [i for i in ints if i is not None]


def integer_field(payload: dict, name: str) -> int | None:
    """An integer as JSON Schema counts them (`as_int`)."""
    value = payload.get(name)
    if value is None:
        return None
    integer = as_int(value)
    if integer is None:
        raise invalid(f"`{name}` must be an integer", param=name)
    return integer


def int_list_field(payload: dict, name: str) -> list[int]:
    """A list of integers (`as_int` each); [] when absent or null."""
    value = payload.get(name)
    if value is None:
        return []
    ints = as_ints(value) if isinstance(value, list) else None
    if ints is None:
        raise invalid(f"`{name}` must be a list of integers", param=name)
    return ints


def check_json_content_type(request: Request) -> None:
    """415 unless the body is declared JSON: `application/json` or `application/<anything>+json`,
    parameters (charset) allowed. Browsers send other types (text/plain, forms) cross-site without
    asking the server first; JSON they cannot send without a CORS preflight, which this server fails."""
    declared = request.headers.get("content-type", "")
    media_type = declared.partition(";")[0].strip().lower()
    kind, _, subtype = media_type.partition("/")
    if kind != "application" or not (subtype == "json" or (subtype.endswith("+json") and len(subtype) > 5)):
        raise APIError(415, f"the request body must be JSON (Content-Type: application/json), got "
                            f"{declared or 'no Content-Type'!r}", code="unsupported_media_type", param="Content-Type")
