"""The body of OpenAI's /v1/chat/completions (what it shares with completions is `OpenAIRequest`):
messages, the chat template's fields, and tools.

Tools (docs/structured-outputs.md#tools): `tools` go to the chat template (`JobCreate.tools`);
`tool_choice` `auto` reads calls out of the answer in the model's format, `required` or a named
function constrains the answer to calls in that format (`ToolFormat.grammar`, the structured-output
path), `none` reads none.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from app.api.openai_schemas import OpenAIRequest
from app.api.schemas import JobCreate
from app.api.tool_schemas import (
    MAX_TOOLS,
    MessageToolCall,
    NamedToolChoice,
    ToolChoice,
    ToolDefinition,
    check_tools,
)
from app.api.toolcalls import ToolUse
from app.api.toolformats import FORMATS, ToolFormat
from app.core.errors import InvalidRequest
from app.core.grammar import Grammar, grammar_problem, json_schema
from app.core.sampling import MAX_LOGPROBS


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class OpenAIMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")  # `name` and the like

    role: Literal["developer", "system", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(
        default=None, description="Text, or a list of text parts (joined); null for an assistant's calls."
    )
    tool_calls: list[MessageToolCall] | None = Field(default=None, description="An assistant's calls.")
    tool_call_id: str | None = Field(
        default=None, max_length=256, description="The call a `tool` message answers."
    )

    @model_validator(mode="after")
    def _fields_of_its_role(self) -> OpenAIMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(
                f"a {self.role} message needs its content (only an assistant's calls may have none)"
            )
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError(
                "a tool message, and only a tool message, names the call it answers (tool_call_id)"
            )
        return self

    def to_chat(self) -> dict[str, Any]:
        """As a job's message (`ChatMessage`) takes it."""
        content = self.content or ""
        text = content if isinstance(content, str) else "".join(p.text for p in content)
        message: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": text,
        }
        if self.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionCreate(OpenAIRequest):
    model_config = ConfigDict(
        extra="allow",
        json_schema_extra={
            "examples": [
                {
                    "model": "SmolLM2-135M-Instruct",
                    "messages": [{"role": "user", "content": "What is the capital of France?"}],
                }
            ]
        },
    )

    messages: list[OpenAIMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, description="Preferred over max_tokens.")
    add_generation_prompt: bool = Field(
        default=True, description="End the rendered chat with the template's generation prompt."
    )
    continue_final_message: bool = Field(
        default=False,
        description="Leave the final message open so the answer continues it; needs add_generation_prompt "
        "false.",
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, description="More variables for the model's chat template."
    )
    logprobs: bool | None = Field(default=False, description="Each token's log probability.")
    top_logprobs: int | None = Field(
        default=None, ge=0, le=MAX_LOGPROBS, description="With logprobs: this many likeliest alternatives."
    )

    tools: list[ToolDefinition] | None = Field(
        default=None, max_length=MAX_TOOLS, description="Functions the model may call (OpenAI's shape)."
    )
    tool_choice: ToolChoice | None = Field(
        default=None,
        description="`auto` (the default with tools): the answer may call them; `required`: it calls one or "
        "more (constrained); a named function: it calls that one (constrained); `none`: no calls read.",
    )
    parallel_tool_calls: bool | None = Field(
        default=None, description="False: one call at most (default true: several)."
    )

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionCreate:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self

    @model_validator(mode="after")
    def _tool_choice_among_tools(self) -> ChatCompletionCreate:
        if self.tools:
            check_tools(self.tools)
        choice = self.tool_choice
        if choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice needs tools to choose from")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in self._names():
            raise ValueError(
                f"tool_choice names function {choice.function.name!r}, which is not among the tools "
                f"({', '.join(self._names())})"
            )
        return self

    def _names(self) -> list[str]:
        return [t.function.name for t in self.tools or ()]

    @property
    def tool_mode(self) -> Literal["none", "auto", "required", "named"]:
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    def tool_use(self, tool_format: ToolFormat) -> ToolUse | None:
        """How the answer holds calls (None: it is read as text)."""
        if self.tool_mode == "none":
            return None
        return ToolUse(
            tool_format, forced=self.tool_mode != "auto", parallel=self.parallel_tool_calls is not False
        )

    def _tools_grammar(self, tool_format: ToolFormat) -> Grammar:
        """The calls a `required` or named answer is constrained to; 422 for a tool whose parameters
        the engine cannot compile."""
        tools = self.tools or []
        if isinstance(self.tool_choice, NamedToolChoice):
            tools = [t for t in tools if t.function.name == self.tool_choice.function.name]
        for tool in tools:
            problem = grammar_problem(json_schema(tool.function.arguments_schema()))
            if problem is not None:
                raise InvalidRequest(
                    f"tools: the parameters of {tool.function.name!r} cannot be compiled: {problem}"
                )
        grammar = tool_format.grammar(
            tools, parallel=self.tool_mode == "required" and self.parallel_tool_calls is not False
        )
        problem = grammar_problem(grammar)
        if problem is not None:
            raise InvalidRequest(f"tools: the calls' grammar cannot be compiled: {problem}")
        return grammar

    @property
    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def to_job(self, tool_format: ToolFormat | None = None) -> JobCreate:
        """`tool_format`: the format of the model the job goes to (`ModelInfo.tool_format`), which a
        `required` or named tool_choice constrains the answer to (hermes when not given)."""
        tool_format = tool_format or FORMATS["hermes"]
        grammar = self.output_grammar()
        if self.tool_mode in ("required", "named"):
            if grammar is not None:
                raise InvalidRequest(
                    "tool_choice required or a named function constrains the answer to calls: "
                    "it cannot be used with another structured output"
                )
            grammar = self._tools_grammar(tool_format)
        job = self._job(
            messages=[m.to_chat() for m in self.messages],
            max_tokens=self.max_completion_tokens or self.max_tokens,
            grammar=grammar,
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
            chat_template_kwargs=self.chat_template_kwargs,
            tools=[t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None,
        )
        if self.tool_mode != "none" and tool_format.keeps_special_tokens:
            job = job.model_copy(update={"skip_special_tokens": False})  # the calls' marker is one
        return job
