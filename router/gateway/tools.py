"""Tools in the chat API: `tools`, `tool_choice`, `parallel_tool_calls`, and `tool` messages and
assistant `tool_calls` in the conversation.

    tool_choice "none"       the tools are not shown to the model; its output is content
    tool_choice "auto"       (the default with tools) the chat template renders the tools; the model's
                             output is parsed by its family's parser (`router.gateway.tool_parsers`)
    tool_choice "required"   the output is a grammar's: a JSON list of {"name", "parameters"} of the
                             tools (one item unless `parallel_tool_calls`), read as the calls
    a named function         the output is a grammar's: that function's arguments (its `parameters`
                             schema), read as its one call

So `required` and named choices are enforced by the sampler, not hoped for (vLLM's way). A chat
template that knows tools (it names `tools`) gets them and the messages as they are; for one that
does not, the tools are described in a system message in the hermes form and earlier calls and
results are written into the messages in that form.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from common.grammar_spec import GrammarSpec
from router.gateway.errors import invalid
from router.gateway.json_body import typed_field
from router.gateway.tool_parsers import ToolCall, new_call, parse, start_marker

MAX_TOOLS = 128
FUNCTION_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


@dataclass(frozen=True)
class ToolAsk:
    """A chat request's tools, and how it may use them."""

    tools: tuple[dict, ...]  # {"name", "description", "parameters"} each
    choice: str  # "auto" | "required" | "function" (a named one)
    function: str = ""  # the named function
    parallel: bool = True
    parser: str = "hermes"

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "function")


def tools_field(payload: dict, parser: str) -> ToolAsk | None:
    """The request's `tools` and `tool_choice`; None when it has none, or chooses "none"."""
    tools = payload.get("tools")
    if tools is None or tools == []:
        if payload.get("tool_choice") not in (None, "none", "auto"):
            raise invalid("`tool_choice` names a tool, but `tools` is empty", param="tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise invalid(f"`tools` must be a list of at most {MAX_TOOLS} tools", param="tools")
    functions = tuple(_function(tool, f"tools[{i}]") for i, tool in enumerate(tools))
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise invalid("`tools` names a function twice", param="tools")
    parallel = typed_field(payload, "parallel_tool_calls", bool)
    choice, function = _choice(payload.get("tool_choice", "auto"), names)
    if choice == "none":
        return None
    return ToolAsk(functions, choice, function, True if parallel is None else parallel, parser)


def _function(tool: Any, param: str) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise invalid(f"`{param}` must be {{\"type\": \"function\", \"function\": {{...}}}}", param=param)
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.match(name):
        raise invalid(f"`{param}.function.name` must be 1-64 letters, digits, _ or -", param=f"{param}.function.name")
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise invalid(f"`{param}.function.parameters` must be a JSON schema (an object)",
                      param=f"{param}.function.parameters")
    description = function.get("description") or ""
    if not isinstance(description, str):
        raise invalid(f"`{param}.function.description` must be a string", param=f"{param}.function.description")
    if function.get("strict") is not None and not isinstance(function["strict"], bool):
        raise invalid(f"`{param}.function.strict` must be a boolean", param=f"{param}.function.strict")
    return {"name": name, "description": description, "parameters": parameters}


def _choice(choice: Any, names: list[str]) -> tuple[str, str]:
    if choice in ("none", "auto", "required"):
        return choice, ""
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise invalid(f"`tool_choice` names {name!r}, which is not among `tools`", param="tool_choice")
        return "function", name
    raise invalid("`tool_choice` must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\"}}",
                  param="tool_choice")


def forced_grammar(ask: ToolAsk) -> GrammarSpec | None:
    """The grammar of a `required` or named choice (None for `auto`)."""
    if ask.choice == "function":
        return GrammarSpec.json_schema(next(f["parameters"] for f in ask.tools if f["name"] == ask.function))
    if ask.choice != "required":
        return None
    call = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
             "properties": {"name": {"enum": [f["name"]]}, "parameters": f["parameters"]}} for f in ask.tools]
    return GrammarSpec.json_schema({"type": "array", "minItems": 1, **({} if ask.parallel else {"maxItems": 1}),
                                    "items": {"anyOf": call}})


def output_calls(ask: ToolAsk, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished output."""
    if ask.choice == "function":
        return None, [new_call(ask.function, text)]
    if ask.choice == "required":
        try:
            return None, [new_call(item["name"], item["parameters"]) for item in json.loads(text)]
        except (json.JSONDecodeError, KeyError, TypeError):  # cut by max_tokens: not a list of calls yet
            return text, []
    content, calls = parse(ask.parser, text)
    return content, calls if ask.parallel else calls[:1]


class ContentStream:
    """The content part of a streamed output with tools: text passes until the calls begin (a forced
    choice's output is all calls); text that may be the start of the marker waits."""

    def __init__(self, ask: ToolAsk):
        self.ask = ask  # the tools the output's calls are read against
        self._marker = "" if ask.forced else start_marker(ask.parser)
        self._held, self.in_calls = "", ask.forced

    def feed(self, text: str) -> str:
        if self.in_calls:
            return ""
        text, self._held = self._held + text, ""
        at = text.find(self._marker)
        if at >= 0:
            self.in_calls = True
            return text[:at]
        keep = next((k for k in range(min(len(self._marker) - 1, len(text)), 0, -1)
                     if self._marker.startswith(text[-k:])), 0)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        """At the end, without calls: what was held back is content after all."""
        held, self._held = ("" if self.in_calls else self._held), ""
        return held


def render(messages: list[dict], ask: ToolAsk | None, template: str | None) -> tuple[list[dict], list[dict] | None]:
    """(the messages for the chat template, its `tools` or None)."""
    native = template is not None and "tools" in template
    if native:
        tools = [{"type": "function", "function": f} for f in ask.tools] if ask is not None else None
        return [_native(m) for m in messages], tools
    out = [_hermes_message(m) for m in messages]
    if ask is not None:
        system = _describe(ask.tools)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{system}"}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out, None


def _describe(tools: tuple[dict, ...]) -> str:
    lines = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in tools)
    return ("You can call these functions (their JSON schemas are inside <tools></tools>):\n<tools>\n"
            f"{lines}\n</tools>\nTo call one, answer with "
            "<tool_call>{\"name\": NAME, \"arguments\": {...}}</tool_call>, one tag per call.")


def _native(message: dict) -> dict:
    """A message as templates that know tools read it: a call's arguments as an object."""
    if "tool_calls" not in message:
        return message
    calls = []
    for call in message["tool_calls"]:
        try:
            arguments = json.loads(call["function"]["arguments"])
        except json.JSONDecodeError:
            arguments = call["function"]["arguments"]
        calls.append({**call, "function": {**call["function"], "arguments": arguments}})
    return {**message, "tool_calls": calls}


def _hermes_message(message: dict) -> dict:
    """A message for a template without tools: calls and results written into the content."""
    if message["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
    if "tool_calls" in message:
        calls = "\n".join('<tool_call>{"name": %s, "arguments": %s}</tool_call>' % (  # noqa: UP031 - JSON's braces
            json.dumps(c["function"]["name"]), c["function"]["arguments"]) for c in message["tool_calls"])
        return {"role": "assistant", "content": f"{message['content']}\n{calls}".strip()}
    return message
