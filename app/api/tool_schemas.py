"""Tools in requests, in OpenAI's shapes: the functions a chat may call (`tools`), which it must call
(`tool_choice`), and the calls an assistant message made (`tool_calls`), answered by `tool` messages.

A job takes the tool definitions and the messages' calls as the chat template renders them
(`JobCreate.tools`, `ChatMessage.tool_calls`); the OpenAI endpoint reads the answer's calls back out
(`app.api.toolformats`). See docs/structured-outputs.md#tools.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# OpenAI's rule for a function's name.
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
MAX_TOOLS = 128  # OpenAI's limit on a request's tools


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(pattern=NAME_PATTERN, description="a-z, A-Z, 0-9, _ and -, at most 64.")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        default=None, description="A JSON schema of the arguments object; left out, no arguments."
    )
    strict: bool | None = Field(default=None, description="Accepted; a forced call always follows it.")

    @field_validator("parameters")
    @classmethod
    def _an_object_schema(cls, parameters: dict[str, Any] | None) -> dict[str, Any] | None:
        if parameters is not None and parameters.get("type", "object") != "object":
            raise ValueError(
                f"a function's parameters are a JSON schema of type object, not {parameters['type']!r}"
            )
        return parameters

    def arguments_schema(self) -> dict[str, Any]:
        """The schema the arguments follow; no parameters is no arguments (`{}`), as OpenAI reads it."""
        if self.parameters is None:
            return {"type": "object", "properties": {}, "additionalProperties": False}
        return self.parameters


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = Field(description="Only functions.")
    function: FunctionDefinition

    def for_template(self) -> dict[str, Any]:
        """As chat templates read a tool (transformers' and vLLM's form)."""
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    """`{"type": "function", "function": {"name": ...}}`: that function must be called, once."""

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(BaseModel):
    name: str = Field(pattern=NAME_PATTERN)
    arguments: str = Field(description="The arguments as a JSON object's text.")

    @field_validator("arguments")
    @classmethod
    def _a_json_object(cls, arguments: str) -> str:
        try:
            value = json.loads(arguments)
        except ValueError:
            raise ValueError(
                "a tool call's arguments are the text of a JSON object, and these are not JSON"
            ) from None
        if not isinstance(value, dict):
            raise ValueError("a tool call's arguments are the text of a JSON object")
        return arguments


class MessageToolCall(BaseModel):
    """A call an assistant message made."""

    model_config = ConfigDict(extra="ignore")

    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: CalledFunction

    def for_template(self) -> dict[str, Any]:
        """As chat templates read a call: its arguments an object (vLLM's form), not their text."""
        function = {"name": self.function.name, "arguments": json.loads(self.function.arguments)}
        return {"id": self.id, "type": "function", "function": function}


def check_tools(tools: list[ToolDefinition]) -> None:
    """Names are unique (raises ValueError naming the first one given twice)."""
    seen: set[str] = set()
    for tool in tools:
        if tool.function.name in seen:
            raise ValueError(
                f"tool {tool.function.name!r} is defined twice; each function needs its own name"
            )
        seen.add(tool.function.name)
