"""The structured-output fields of the gateway's request bodies, as pydantic models for its OpenAPI
document (`router.gateway.structured` reads them). A grammar that does not parse is a 400
`invalid_grammar` naming its field, which the document cannot say."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="The JSON schema the output follows.")
    strict: bool | None = Field(None, description="Properties the schema does not name are refused.")


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]


class JsonObjectFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["json_object"]


class JsonSchemaResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaResponseFormat, Field(discriminator="type")]
NonEmpty = Annotated[str, Field(min_length=1)]


class StructuredOutputs(BaseModel):
    """Extension (vLLM's): exactly one of these; the output is sampled within it."""

    model_config = ConfigDict(extra="allow")
    json_: dict[str, Any] | str | None = Field(None, alias="json", description="A JSON schema.")
    regex: NonEmpty | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = Field(None, description="The output is one of these.")
    grammar: NonEmpty | None = Field(None, description="EBNF (GBNF), root rule `root`.")
    json_object: Literal[True] | None = None
