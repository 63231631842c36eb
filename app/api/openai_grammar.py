"""The structured-output fields of the OpenAI request bodies (OpenAI's `response_format`, vLLM's
`structured_outputs`) and the grammar each one asks for (`OpenAIRequest.output_grammar` checks it)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from app.core.errors import InvalidRequest
from app.core.grammar import Grammar, json_schema


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`: the schema the answer follows (`strict` or not, it is enforced)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str | None = Field(default=None, description="Accepted and ignored.")
    description: str | None = Field(default=None, description="Accepted and ignored.")
    schema_: dict[str, Any] = Field(
        alias="schema", description="A JSON schema; the answer is JSON that follows it."
    )
    strict: StrictBool | None = Field(default=None, description="Accepted; the schema is always enforced.")


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = Field(default=None, description="With type json_schema.")


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one of its keys."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json", description="A JSON schema.")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = Field(default=None, description="A Lark grammar (llguidance's dialect).")
    json_object: bool | None = None


def schema_grammar(schema: dict[str, Any] | str | None) -> Grammar | None:
    if schema is None:
        return None
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise InvalidRequest("the JSON schema is not JSON") from None
    if not isinstance(schema, dict):
        raise InvalidRequest("a JSON schema is a JSON object")
    return json_schema(schema)


def choice_grammar(choices: list[str] | None) -> Grammar | None:
    if choices is None:
        return None
    if not choices:
        raise InvalidRequest("a choice needs at least one string")
    return Grammar("choice", json.dumps(choices))


def response_format_grammar(value: ResponseFormat | None) -> Grammar | None:
    if value is None or value.type == "text":
        return None
    if value.type == "json_object":
        return json_schema({"type": "object"})
    if value.json_schema is None:
        raise InvalidRequest("response_format of type json_schema needs its json_schema")
    return json_schema(value.json_schema.schema_)


def structured_grammar(value: StructuredOutputs | None) -> Grammar | None:
    if value is None:
        return None
    given = [
        grammar
        for grammar in (
            schema_grammar(value.json_),
            Grammar("regex", value.regex) if value.regex is not None else None,
            choice_grammar(value.choice),
            Grammar("lark", value.grammar) if value.grammar is not None else None,
            json_schema({"type": "object"}) if value.json_object else None,
        )
        if grammar is not None
    ]
    if len(given) != 1:
        raise InvalidRequest(
            "structured_outputs takes exactly one of json, regex, choice, grammar, json_object"
        )
    return given[0]
