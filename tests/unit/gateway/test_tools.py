"""Tools: the parsers per model family, the held-back content of a stream, the grammars of forced
choices, the rendering for templates with and without tools; then through the gateway over a real
SmolLM2 engine: a named or required choice always yields calls whose arguments follow the schema,
whole and streamed (the deltas reassemble), and tool results in the conversation are accepted."""

from __future__ import annotations

import json

import jsonschema

from common.grammar_spec import grammar_of
from router.gateway.tool_parsers import parse, parser_for
from router.gateway.tools import ContentStream, ToolAsk, forced_grammar, output_calls, render

WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                          "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}
TIME = {"name": "get_time", "description": "The time in a city.",
        "parameters": {"type": "object", "required": ["city"], "additionalProperties": False,
                       "properties": {"city": {"enum": ["Paris", "Oslo"]}}}}
TOOLS = [{"type": "function", "function": f} for f in (WEATHER, TIME)]
QUESTION = [{"role": "user", "content": "What is the weather in Oslo for the next 3 days?"}]


def test_each_family_parser_reads_its_calls_and_leaves_other_text_as_content():
    content, calls = parse("hermes", 'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
                                     '<tool_call>{"name": "g", "arguments": {}}')  # the second cut off at its end
    assert content == "Let me check." and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1}),
                                                                                                ("g", {})]
    assert parse("hermes", "no calls <tool_call>not json</tool_call>") == ("no calls <tool_call>not json</tool_call>",
                                                                           [])
    _, calls = parse("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"x": "y"}}; {"name": "g", '
                                    '"parameters": {}}')
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": "y"}), ("g", {})]
    content, calls = parse("mistral", 'ok [TOOL_CALLS][{"name": "f", "arguments": {"n": 2}}]')
    assert content == "ok" and calls[0].name == "f" and calls[0].id.startswith("call_")
    assert parser_for("auto", "{{ '[TOOL_CALLS]' }}") == "mistral" and parser_for("auto", None) == "hermes"
    assert parser_for("auto", "<|python_tag|>") == "llama3_json"


def test_streamed_content_is_held_back_where_a_call_may_begin():
    stream = ContentStream(ToolAsk(tuple([WEATHER]), "auto"))
    assert stream.feed("Sure <tool") == "Sure " and stream.feed("_ca") == ""
    assert stream.feed('ll>{"name"') == "" and stream.in_calls and stream.flush() == ""
    plain = ContentStream(ToolAsk(tuple([WEATHER]), "auto"))
    assert plain.feed("a <to") == "a " and plain.flush() == "<to"  # no call came: it was content
    assert ContentStream(ToolAsk(tuple([WEATHER]), "required")).feed("[{") == ""


def test_forced_choices_are_grammars_whose_output_reads_as_calls():
    named = ToolAsk((WEATHER, TIME), "function", "get_time")
    assert json.loads(forced_grammar(named).text) == TIME["parameters"]
    required = ToolAsk((WEATHER, TIME), "required", parallel=False)
    schema = json.loads(forced_grammar(required).text)
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    for ask in (named, required):
        grammar_of(forced_grammar(ask))  # parses
    _, calls = output_calls(required, '[{"name": "get_weather", "parameters": {"city": "Oslo", "days": 3}}]')
    assert calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Oslo", "days": 3}
    assert output_calls(named, '{"city": "Paris"}')[1][0].arguments == '{"city": "Paris"}'


def test_rendering_for_templates_with_and_without_tools():
    ask = ToolAsk((WEATHER,), "auto")
    history = [{"role": "system", "content": "Be brief."}, *QUESTION,
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
               {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    messages, tools = render(history, ask, "{{ messages }}")  # a template that knows no tools
    assert tools is None
    assert messages[0]["content"].startswith("Be brief.\n\n") and "get_weather" in messages[0]["content"]
    assert messages[2] == {"role": "assistant", "content": '<tool_call>{"name": "get_weather", "arguments": '
                                                           '{"city": "Oslo"}}</tool_call>'}
    assert messages[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    messages, tools = render(history, ask, "{% for t in tools %}{% endfor %}")
    assert tools == [{"type": "function", "function": WEATHER}]
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"} and messages[3]["role"] == "tool"


def test_a_named_choice_always_calls_it_whole_and_streamed(client):
    body = {"messages": QUESTION, "tools": TOOLS, "max_tokens": 40, "temperature": 0,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    out = client.post("/v1/chat/completions", json=body).json()
    choice = out["choices"][0]
    [call] = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["parameters"])
    frames = [json.loads(f[6:]) for f in client.post("/v1/chat/completions", json={**body, "stream": True}).text
              .split("\n\n") if f.startswith("data: {")]
    deltas = [c["delta"] for f in frames for c in f["choices"]]
    streamed = [t for d in deltas for t in d.get("tool_calls") or ()]
    assert [t["function"]["arguments"] for t in streamed] == [call["function"]["arguments"]]
    assert not any(d.get("content") for d in deltas) and frames[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_required_calls_follow_their_tools_schemas_and_a_result_continues_the_conversation(client):
    body = {"messages": QUESTION, "tools": TOOLS, "max_tokens": 60, "temperature": 1.0, "seed": 2,
            "tool_choice": "required", "parallel_tool_calls": False}
    message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    [call] = message["tool_calls"]
    schema = {"get_weather": WEATHER, "get_time": TIME}[call["function"]["name"]]["parameters"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), schema)
    follow = {"messages": [*QUESTION, message, {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}],
              "tools": TOOLS, "max_tokens": 8, "temperature": 0}
    r = client.post("/v1/chat/completions", json=follow)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant", r.text


def test_tokenize_renders_the_tools_as_a_chat_does(client):
    body = {"messages": QUESTION, "tools": TOOLS, "max_tokens": 1, "temperature": 0, "return_token_ids": True}
    chat = client.post("/v1/chat/completions", json=body).json()
    tokens = client.post("/tokenize", json={"messages": QUESTION, "tools": TOOLS}).json()["tokens"]
    plain = client.post("/tokenize", json={"messages": QUESTION}).json()["tokens"]
    assert tokens == chat["prompt_token_ids"] and len(tokens) > len(plain)
