"""The tool fields of the chat API, as pydantic models for the gateway's OpenAPI document
(`router.gateway.tools` and `router.gateway.messages` read them)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from router.gateway.tools import FUNCTION_NAME, MAX_TOOLS


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class ToolMessage(BaseModel):
    """A tool's result, answering the assistant's call `tool_call_id`."""

    model_config = ConfigDict(extra="allow")
    role: Literal["tool"]
    content: str | list[TextPart]
    tool_call_id: str


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="A JSON object's text.")


class ToolCallItem(BaseModel):
    """A call the assistant made (in a response, or in the conversation sent back)."""

    model_config = ConfigDict(extra="allow")
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCall


class ToolCallDelta(ToolCallItem):
    """A streamed call: the whole call in the output's last delta."""

    index: int = Field(ge=0)


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: Annotated[str, Field(pattern=FUNCTION_NAME.pattern)]
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON schema of the arguments.")
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    function: NamedFunction


Tools = Annotated[list[Tool], Field(max_length=MAX_TOOLS)]
ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
