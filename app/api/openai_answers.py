"""Response bodies of the OpenAI-compatible endpoints, in OpenAI's shapes (vLLM's additions where a
request asks for them): completions and chat completions, whole and as stream chunks, their log
probabilities, and the model list. Built by `app.api.openai_replies`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """A completion's (or chunk's) tokens with their log probabilities, as OpenAI's legacy
    completions give them: `top_logprobs` maps the likeliest tokens and the chosen one to theirs."""

    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class TokenIds(BaseModel):
    """vLLM's `return_token_ids` fields: sent only when asked for (absent, not null, otherwise)."""

    @model_serializer(mode="wrap")
    def _ids_when_asked(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        dumped = handler(self)
        return {k: v for k, v in dumped.items() if v is not None or k not in TOKEN_ID_FIELDS}


TOKEN_ID_FIELDS = ("prompt_token_ids", "token_ids")


class CompletionChoice(TokenIds):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_token_ids: list[int] | None = Field(default=None, description="return_token_ids: the prompt's.")
    token_ids: list[int] | None = Field(default=None, description="return_token_ids: this text's tokens.")


class Completion(BaseModel):
    """A completion, and each chunk of a streamed one (the same shape, as OpenAI sends them)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: CompletionUsage | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="The arguments object's JSON text, as the model wrote it.")


class ToolCall(BaseModel):
    id: str = Field(description="`call_...`; a `tool` message answers it by this id.")
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = Field(description="The answer's text; null when it only calls tools.")
    refusal: None = None
    tool_calls: list[ToolCall] | None = Field(default=None, description="The tools it calls, if any.")

    @model_serializer(mode="wrap")
    def _calls_when_made(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        dumped = handler(self)
        return {k: v for k, v in dumped.items() if k != "tool_calls" or v is not None}


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = Field(description="The token's text as UTF-8 bytes.")


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class ChatChoice(TokenIds):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    token_ids: list[int] | None = Field(default=None, description="return_token_ids: the answer's tokens.")


class ChatCompletion(TokenIds):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: CompletionUsage
    prompt_token_ids: list[int] | None = Field(default=None, description="return_token_ids: the prompt's.")


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _set_fields_only(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ToolCallDelta(BaseModel):
    """A streamed call: its first delta has the id, the type and the name (arguments ""), the next ones
    pieces of the arguments' text, as OpenAI streams them."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta

    @model_serializer(mode="wrap")
    def _set_fields_only(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _set_fields_only(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # As OpenAI sends them: the role in the first delta, then only content; the last one empty.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(TokenIds):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = Field(default=None, description="return_token_ids: this chunk's tokens.")
    finish_reason: str | None = None


class ChatCompletionChunk(TokenIds):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChunkChoice]
    usage: CompletionUsage | None = None
    prompt_token_ids: list[int] | None = Field(
        default=None, description="return_token_ids: the prompt's, in the first chunk."
    )


class RoutePolicyCard(BaseModel):
    """A route's policy as /v1/models shows it (docs/models.md#routes): its two models and thresholds."""

    small: str
    large: str
    max_prompt_chars: int = Field(description="A longer prompt (characters) goes to the large model.")
    max_tokens: int = Field(description="A request for more tokens goes to the large model.")
    max_complexity: float = Field(description="A higher complexity score (0..1) goes to the large model.")
    deadline_s: float = Field(description="Without timeout_s, a predicted queue wait past this falls back.")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "conveyor"
    # Conveyor's: which endpoints take it; a route is a name for two generation models (`auto`).
    kind: Literal["generation", "embedding", "route"] = "generation"
    route: RoutePolicyCard | None = Field(default=None, description="A route's policy (kind `route`).")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
