"""Request and response bodies of the OpenAI-compatible endpoints, in OpenAI's own shapes.

A request translates to a `JobCreate` (`to_job`); responses are built from the job's record. Fields of
OpenAI's API that would change the answer and that Conveyor does not implement (logprobs, tools,
penalties, several choices, ...) are refused with 422 rather than silently ignored; the rest of
OpenAI's bookkeeping fields (`user`, `metadata`, `store`, ...) are accepted and ignored.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetJsonSchemaHandler,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from app.api.schemas import ChatMessage, JobCreate, Priority, checked_temperature, temperature_schema
from app.core.errors import InvalidRequest
from app.core.grammar import Grammar, grammar_problem, json_schema
from app.core.sampling import MAX_TEMPERATURE, MAX_TOP_K, MIN_TEMPERATURE, MIN_TOP_P

# Fields OpenAI defines that Conveyor does not implement: accepted only with these neutral values.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "web_search_options": (None,),
    # vLLM's sampling extensions, which benchmark tools may pass through.
    "repetition_penalty": (None, 1),
    "min_p": (None, 0),
    "stop_token_ids": (None, []),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1),
    "include_stop_str_in_output": (None, False),
}


class StreamOptions(BaseModel):
    """OpenAI's stream options; keys it adds that change nothing here (`include_obfuscation`) are
    ignored."""

    include_usage: bool = Field(default=False, description="A last chunk with the usage, no choices.")
    continuous_usage_stats: bool = Field(
        default=False, description="With include_usage: every chunk carries the usage so far (vLLM's)."
    )


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`: the schema the answer follows (`strict` or not, it is enforced)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str | None = Field(default=None, description="Accepted and ignored.")
    description: str | None = Field(default=None, description="Accepted and ignored.")
    schema_: dict[str, Any] = Field(
        alias="schema", description="A JSON schema; the answer is JSON that follows it."
    )
    strict: bool | None = Field(default=None, description="Accepted; the schema is always enforced.")


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


class OpenAIRequest(BaseModel):
    """What completions and chat completions share. `top_k`, `ignore_eos`, `min_tokens` (as vLLM has
    them), `priority` and `timeout_s` (Conveyor's own) are not OpenAI's: the OpenAI client sends them
    in `extra_body`."""

    model_config = ConfigDict(extra="allow")

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema: Any, handler: GetJsonSchemaHandler) -> dict[str, Any]:
        """Each unsupported field declared with the only values it is accepted with (`UNSUPPORTED`),
        so that a request made from the schema is one the server takes."""
        schema = handler(core_schema)
        target = handler.resolve_ref_schema(schema)
        properties = target.setdefault("properties", {})
        for name, accepted in UNSUPPORTED.items():
            properties.setdefault(
                name,
                {"enum": list(accepted), "description": "Not supported: accepted only with these values."},
            )
        return dict(schema)

    model: str | None = Field(default=None, description="Model name; the configured default when omitted.")
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(
        default=None,
        ge=0.0,
        le=MAX_TEMPERATURE,
        description=f"0 means greedy; otherwise {MIN_TEMPERATURE:g} to {MAX_TEMPERATURE:g}; default 1.",
        json_schema_extra=temperature_schema,
    )
    top_p: float | None = Field(default=None, ge=MIN_TOP_P, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)  # a job's seed (JobCreate.seed)
    stop: str | list[str] | None = None
    # The schema states the rule; _one_choice enforces it with its own message.
    n: int | None = Field(
        default=None,
        description="Only 1: one choice per request.",
        json_schema_extra={"minimum": 1, "maximum": 1},
    )
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, description="Accepted and ignored.")
    top_k: int = Field(default=0, ge=0, le=MAX_TOP_K)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0, description="End of sequence cannot end it sooner (vLLM's).")
    priority: Priority = "normal"
    timeout_s: float | None = Field(default=None, gt=0)
    # Structured outputs (app/core/grammar.py): OpenAI's response_format and vLLM's fields, one at most.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value: float | None) -> float | None:
        return None if value is None else checked_temperature(value)

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int | None) -> int | None:
        if n not in (None, 1):
            raise ValueError(f"only n=1 is supported (one choice per request), not {n}")
        return n

    @model_validator(mode="after")
    def _no_unsupported(self) -> OpenAIRequest:
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED and value not in UNSUPPORTED[name]:
                raise ValueError(f"{name!r} is not supported by this server; leave it out")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk: asked with include_usage, as vLLM reads it."""
        return bool(self.include_usage and self.stream_options and self.stream_options.continuous_usage_stats)

    def to_job(self) -> JobCreate:
        """The job this request asks for (raises InvalidRequest for what a job cannot take)."""
        raise NotImplementedError

    def output_grammar(self) -> Grammar | None:
        """The grammar the answer is constrained to, checked (InvalidRequest naming the field and the
        engine's problem); None for free text."""
        asked = {
            name: grammar
            for name, grammar in (
                ("response_format", _response_format_grammar(self.response_format)),
                ("structured_outputs", _structured_grammar(self.structured_outputs)),
                ("guided_json", _schema_grammar(self.guided_json)),
                (
                    "guided_regex",
                    Grammar("regex", self.guided_regex) if self.guided_regex is not None else None,
                ),
                ("guided_choice", _choice_grammar(self.guided_choice)),
                ("guided_grammar", Grammar("lark", self.guided_grammar) if self.guided_grammar else None),
            )
            if grammar is not None
        }
        if len(asked) > 1:
            raise InvalidRequest(f"give one structured output at most, not {' and '.join(asked)}")
        if not asked:
            return None
        ((name, grammar),) = asked.items()
        problem = grammar_problem(grammar)
        if problem is not None:
            raise InvalidRequest(f"{name}: the engine cannot compile it: {problem}")
        return grammar

    def _job(self, *, max_tokens: int | None, **input: Any) -> JobCreate:
        fields: dict[str, Any] = {
            "model": self.model,
            "max_tokens": max_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop": self.stop,
            "priority": self.priority,
            "timeout_s": self.timeout_s,
            "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens,
        }
        try:
            return JobCreate.model_validate({**input, **fields})
        except ValidationError as exc:  # a value OpenAI allows that a job does not (a negative seed)
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise InvalidRequest(f"{where}: {first['msg']}" if where else first["msg"]) from None


def _schema_grammar(schema: dict[str, Any] | str | None) -> Grammar | None:
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


def _choice_grammar(choices: list[str] | None) -> Grammar | None:
    if choices is None:
        return None
    if not choices:
        raise InvalidRequest("a choice needs at least one string")
    return Grammar("choice", json.dumps(choices))


def _response_format_grammar(value: ResponseFormat | None) -> Grammar | None:
    if value is None or value.type == "text":
        return None
    if value.type == "json_object":
        return json_schema({"type": "object"})
    if value.json_schema is None:
        raise InvalidRequest("response_format of type json_schema needs its json_schema")
    return json_schema(value.json_schema.schema_)


def _structured_grammar(value: StructuredOutputs | None) -> Grammar | None:
    if value is None:
        return None
    given = [
        grammar
        for grammar in (
            _schema_grammar(value.json_),
            Grammar("regex", value.regex) if value.regex is not None else None,
            _choice_grammar(value.choice),
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


class CompletionCreate(OpenAIRequest):
    model_config = ConfigDict(
        extra="allow",
        json_schema_extra={"examples": [{"model": "SmolLM2-135M-Instruct", "prompt": "Once upon a time"}]},
    )

    prompt: str | list[str] = Field(
        description="One prompt (a list of one string is accepted too).",
        json_schema_extra={"minItems": 1, "maxItems": 1},  # for the list; _one_prompt enforces it
    )

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list[str]) -> str | list[str]:
        if isinstance(prompt, list) and len(prompt) != 1:
            raise ValueError(f"exactly one prompt per request is supported, not {len(prompt)}")
        return prompt

    def to_job(self) -> JobCreate:
        prompt = self.prompt if isinstance(self.prompt, str) else self.prompt[0]
        return self._job(prompt=prompt, max_tokens=self.max_tokens, grammar=self.output_grammar())


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class OpenAIMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")  # `name` and the like

    role: Literal["developer", "system", "user", "assistant"]
    content: str | list[TextPart] = Field(description="Text, or a list of text parts (joined).")

    def to_chat(self) -> ChatMessage:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return ChatMessage(role="system" if self.role == "developer" else self.role, content=text)


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

    def to_job(self) -> JobCreate:
        return self._job(
            messages=[m.to_chat() for m in self.messages],
            max_tokens=self.max_completion_tokens or self.max_tokens,
            grammar=self.output_grammar(),
        )


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class Completion(BaseModel):
    """A completion, and each chunk of a streamed one (the same shape, as OpenAI sends them)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: CompletionUsage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    refusal: None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: CompletionUsage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _set_fields_only(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # As OpenAI sends them: the role in the first delta, then only content; the last one empty.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChunkChoice]
    usage: CompletionUsage | None = None


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
