"""Tool calls in a model's output text, one parser per model family (as vLLM's `--tool-call-parser`).

    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>, any number (Qwen2, Hermes, and
                 every model whose chat template has no tools: the gateway then describes the tools in
                 this form itself, `router.gateway.tools`)
    llama3_json  {"name": ..., "parameters": {...}} objects separated by ";", after an optional
                 <|python_tag|> (Llama 3.1+)
    mistral      [TOOL_CALLS] followed by a JSON list of {"name", "arguments"} (Mistral)

`auto` picks by the chat template: the family whose markers it writes, else hermes. A parser returns
the content before the calls (None when there is none) and the calls; text it cannot read as calls
stays content.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

PARSERS = ("hermes", "llama3_json", "mistral")
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text
    id: str = ""

    def body(self, index: int | None = None) -> dict:
        """The OpenAI `tool_calls` item (a streamed delta's carries its `index`)."""
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def new_call(name: str, arguments: Any) -> ToolCall:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(name, text, f"call_{uuid.uuid4().hex[:24]}")


def parser_for(name: str, chat_template: str | None) -> str:
    """The parser `name` names (`auto`: by the template's markers)."""
    if name != "auto":
        if name not in PARSERS:
            raise ValueError(f"unknown tool call parser {name!r}: expected auto or one of {', '.join(PARSERS)}")
        return name
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


def start_marker(parser: str) -> str:
    """The text that begins this family's calls (streamed content is held back from it on)."""
    return {"hermes": "<tool_call>", "llama3_json": "<|python_tag|>", "mistral": "[TOOL_CALLS]"}[parser]


def parse(parser: str, text: str) -> tuple[str | None, list[ToolCall]]:
    return _PARSE[parser](text)


def _hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    at = text.find("<tool_call>")
    if at < 0:
        return text, []
    calls = [call for body in _HERMES.findall(text[at:]) for call in _calls(body)]
    if not calls:
        return text, []
    return text[:at].strip() or None, calls


def _llama3_json(text: str) -> tuple[str | None, list[ToolCall]]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    calls = [call for part in body.split(";") for call in _calls(part.strip(), "parameters")]
    return (None, calls) if calls else (text, [])


def _mistral(text: str) -> tuple[str | None, list[ToolCall]]:
    at = text.find("[TOOL_CALLS]")
    if at < 0:
        return text, []
    calls = _calls(text[at + len("[TOOL_CALLS]"):].strip())
    return (text[:at].strip() or None, calls) if calls else (text, [])


def _calls(body: str, arguments_key: str = "arguments") -> list[ToolCall]:
    """The calls in one JSON object or list of them; [] when it is not that."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return []
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return []
        arguments = item.get(arguments_key, item.get("arguments", item.get("parameters", {})))
        calls.append(new_call(item["name"], arguments))
    return calls


_PARSE: dict[str, Callable[[str], tuple[str | None, list[ToolCall]]]] = {
    "hermes": _hermes, "llama3_json": _llama3_json, "mistral": _mistral}
