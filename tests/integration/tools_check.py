"""One check for every served path (imported by the serve test modules): tool calls through clients
no one here wrote. The `openai` SDK's streaming helper reassembles a forced call's deltas into its
Pydantic arguments; LangChain's `bind_tools` gets a call whose arguments follow the tool; a tool's
result sent back continues the conversation."""

from __future__ import annotations

from typing import Literal

import openai
from pydantic import BaseModel, Field

QUESTION = [{"role": "user", "content": "What is the weather in Oslo for the next 3 days?"}]


class GetWeather(BaseModel):
    """The weather in a city for a few days."""

    city: Literal["Paris", "Oslo", "Lima"]
    days: int = Field(ge=1, le=7)


def check_tools(base_url: str, api_key: str = "none") -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=300)
    tool = openai.pydantic_function_tool(GetWeather)
    with client.chat.completions.stream(model="smollm2", messages=QUESTION, tools=[tool], max_tokens=40,
                                        temperature=0, tool_choice={"type": "function",
                                                                    "function": {"name": "GetWeather"}}) as stream:
        done = stream.get_final_completion()
    [call] = done.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, GetWeather) and done.choices[0].finish_reason == "tool_calls"
    follow = client.chat.completions.create(model="smollm2", max_tokens=8, temperature=0, tools=[tool], messages=[
        *QUESTION, done.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 20 C."}])
    assert follow.choices[0].message.role == "assistant"
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(model="smollm2", base_url=f"{base_url}/v1", api_key=api_key, temperature=0, max_tokens=40,
                      max_retries=0, timeout=300)
    answer = chat.bind_tools([GetWeather], tool_choice="GetWeather").invoke("Weather in Lima, 2 days?")
    [lc_call] = answer.tool_calls
    assert lc_call["name"] == "GetWeather" and GetWeather(**lc_call["args"])
