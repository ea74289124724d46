"""A chat body's `messages`: each checked and read into a plain dict, and the conversation rendered
through the model's chat template (with the request's tools: `router.gateway.tools.render`).

    {role: system | developer | user | assistant, content: str | [text parts]}
    {role: assistant, content: str | null, tool_calls: [{id, type: function, function: {name, arguments}}]}
    {role: tool, content, tool_call_id}
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kernels.model.tokenizer import apply_chat_template
from router.gateway.errors import APIError, invalid
from router.gateway.tools import ToolAsk, render

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


def chat_prompt(payload: dict, tokenizer: Any, history: Sequence[dict] = (),
                tools: ToolAsk | None = None) -> tuple[tuple[dict, ...], list[int]]:
    """(the whole conversation as plain messages, its token ids through the chat template)."""
    messages = payload.get("messages")
    if messages is None:
        raise invalid("`messages` is required", param="messages", code="missing_parameter")
    if not isinstance(messages, list) or not messages:
        raise invalid("`messages` must be a non-empty list", param="messages")
    plain = (*history, *(_message(m, i) for i, m in enumerate(messages)))
    rendered, tool_list = render(list(plain), tools, getattr(tokenizer, "chat_template", None))
    try:
        return plain, apply_chat_template(tokenizer, rendered, tools=tool_list)
    except Exception as exc:  # noqa: BLE001 - the template itself rejects some conversations (jinja raise_exception)
        raise invalid(f"the chat template rejected these messages: {exc}", param="messages") from None


def _message(message: Any, index: int) -> dict:
    """One message as {role, content: str} (with `tool_calls` or `tool_call_id` where it has them);
    text parts are joined by newlines."""
    param = f"messages[{index}]"
    if not isinstance(message, dict):
        raise invalid(f"{param} must be an object with `role` and `content`", param=param)
    role = message.get("role")
    if not isinstance(role, str) or role not in CHAT_ROLES:  # a dict or list is unhashable: test the type first
        raise invalid(f"{param}.role must be one of {sorted(CHAT_ROLES)}, got {role!r}", param=f"{param}.role")
    out: dict[str, Any] = {"role": role,
                           "content": _content(message.get("content"), role, param, bool(message.get("tool_calls")))}
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise invalid(f"{param}.tool_call_id must be a string", param=f"{param}.tool_call_id")
        out["tool_call_id"] = call_id
    elif message.get("tool_calls") is not None:
        if role != "assistant":
            raise invalid(f"{param}: only an assistant message has tool_calls", param=f"{param}.tool_calls")
        out["tool_calls"] = _tool_calls(message["tool_calls"], f"{param}.tool_calls")
    return out


def _content(content: Any, role: str, param: str, has_calls: bool) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(_text_part(p, f"{param}.content[{i}]") for i, p in enumerate(content))
    if content is None and (role == "assistant" or has_calls):
        return ""
    raise invalid(f"{param}.content must be a string or a list of text parts", param=f"{param}.content")


def _tool_calls(calls: Any, param: str) -> list[dict]:
    if not isinstance(calls, list):
        raise invalid(f"{param} must be a list", param=param)
    out = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or not isinstance(function.get("arguments"), str) or not isinstance(call.get("id", ""),
                                                                                    (str, type(None))) \
                or call.get("type") not in (None, "function"):
            raise invalid(f"{param}[{i}] must be {{id, type: function, function: {{name, arguments: a JSON string}}}}",
                          param=f"{param}[{i}]")
        out.append({"id": call.get("id") or "", "type": "function",
                    "function": {"name": function["name"], "arguments": function["arguments"]}})
    return out


def _text_part(part: Any, param: str) -> str:
    if not isinstance(part, dict) or part.get("type") != "text":
        raise unsupported(param, "content parts other than {\"type\": \"text\"}")
    if not isinstance(part.get("text"), str):
        raise invalid(f"{param}.text must be a string", param=f"{param}.text")
    return part["text"]


def unsupported(param: str, what: str | None = None) -> APIError:
    return invalid(f"{what or param} is not supported by this server", param=param, code="unsupported_parameter")
