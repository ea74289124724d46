"""One check for every served path (imported by the serve test modules): structured outputs through
clients no one here wrote. The `openai` SDK's `chat.completions.parse` with a Pydantic model returns
the parsed object; LangChain's `ChatOpenAI.with_structured_output` too; vLLM's `structured_outputs`
(regex, choice) hold; n siblings each follow the schema; sixteen concurrent streams under a JSON schema all parse and
validate; a schema that does not parse, or a grammar that allows no token (found by the worker that samples
the first token), is a 400 naming its field."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

QUESTION = [{"role": "user", "content": "Pick a color and a small number, as JSON."}]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["color", "count", "ok"],
          "properties": {"color": {"enum": ["red", "green", "blue"]},
                         "count": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}}}


class Pick(BaseModel):
    color: Literal["red", "green", "blue"]
    count: int = Field(ge=0, le=99)
    ok: bool


def check_structured(base_url: str, api_key: str = "none") -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=300)
    done = client.chat.completions.parse(model="smollm2", messages=QUESTION, response_format=Pick, max_tokens=40,
                                         temperature=0)
    assert isinstance(done.choices[0].message.parsed, Pick), done.choices[0].message.content
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(model="smollm2", base_url=f"{base_url}/v1", api_key=api_key, temperature=0, max_tokens=40,
                      max_retries=0, timeout=300)
    assert isinstance(chat.with_structured_output(Pick).invoke("Pick a color and a number."), Pick)
    text = client.completions.create(model="smollm2", prompt="A license plate:", max_tokens=12, temperature=1.0,
                                     seed=3, extra_body={"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{3}"}})
    assert re.fullmatch("[A-Z]{3}-[0-9]{3}", text.choices[0].text), text.choices[0].text
    choice = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=8, temperature=1.0, seed=4,
                                            extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.choices[0].message.content in ("yes", "no")
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=8, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "$ref": "#/nowhere"}}})
    assert bad.value.body["param"] == "response_format" and "does not compile" in bad.value.body["message"]
    with pytest.raises(openai.BadRequestError) as dead:  # parses, but allows no token: the worker says so
        client.completions.create(model="smollm2", prompt="x", max_tokens=4,
                                  extra_body={"structured_outputs": {"grammar": "root ::= root root"}})
    assert dead.value.body["param"] == "structured_outputs" and "allows no token" in dead.value.body["message"]
    siblings = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=40, n=3, seed=5,
                                              temperature=1.0, response_format={"type": "json_schema", "json_schema": {
                                                  "name": "pick", "schema": SCHEMA, "strict": True}})
    for choice in siblings.choices:  # each sibling samples under its own matcher
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    asyncio.run(_sixteen_streams(base_url, api_key))


async def _sixteen_streams(base_url: str, api_key: str) -> None:
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=600)
    fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}}

    async def one(seed: int) -> str:
        stream = await client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=40, stream=True,
                                                      temperature=1.0, seed=seed, response_format=fmt)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    texts = await asyncio.gather(*(one(seed) for seed in range(16)))
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > 1, "sixteen seeds gave one answer: the streams were not sampled"
    await client.close()
