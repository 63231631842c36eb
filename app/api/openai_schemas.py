"""Request bodies of the OpenAI-compatible endpoints, in OpenAI's own shapes (the responses' are
`app.api.openai_answers`).

A request translates to a `JobCreate` (`to_job`). Fields of
OpenAI's API (and vLLM's extensions) that would change the answer and that Conveyor does not implement
(tools, several choices, structured output, ...) are refused with 422 rather than silently ignored
(`UNSUPPORTED`); the rest of OpenAI's bookkeeping fields (`user`, `metadata`, `store`, ...) are
accepted and ignored.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetJsonSchemaHandler,
    StrictBool,
    ValidationError,
    field_validator,
    model_validator,
)

from app.api.schemas import (
    BadWord,
    Bias,
    ChatMessage,
    JobCreate,
    Priority,
    TokenId,
    TokenKey,
    checked_temperature,
    only_token_keys,
    temperature_schema,
)
from app.core.errors import InvalidRequest
from app.core.grammar import Grammar, grammar_problem, json_schema
from app.core.sampling import (
    MAX_BAD_WORDS,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    MAX_TOKEN_LIST,
    MAX_TOP_K,
    MIN_REPETITION_PENALTY,
    MIN_TEMPERATURE,
    MIN_TOP_P,
)

# Fields OpenAI defines that Conveyor does not implement: accepted only with these neutral values.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
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
    "use_beam_search": (None, False),
    "length_penalty": (None, 1),
    "include_stop_str_in_output": (None, False),
    "structural_tag": (None,),
    "guided_decoding_backend": (None,),
    "guided_whitespace_pattern": (None,),
    "chat_template": (None,),
    "prompt_logprobs": (None,),
    "spaces_between_special_tokens": (None, True),
    "documents": (None, []),
    "mm_processor_kwargs": (None, {}),
    "media_io_kwargs": (None, {}),
    "logits_processors": (None, []),
    "vllm_xargs": (None, {}),
    "kv_transfer_params": (None, {}),
    "prompt_embeds": (None,),
}


# Chat completions' fields (vLLM's) that a completion has no messages for: refused there unless neutral.
CHAT_ONLY: dict[str, tuple[Any, ...]] = {
    "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
    "chat_template_kwargs": (None, {}),
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
        description=f"0 means greedy; otherwise {MIN_TEMPERATURE:g} to {MAX_TEMPERATURE:g}; left out, the "
        "model's generation_config.json value, else 1.",
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
    top_k: int | None = Field(default=None, ge=0, le=MAX_TOP_K, description="vLLM's; 0 is off.")
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
    min_p: float | None = Field(default=None, ge=0.0, le=1.0, description="vLLM's; 0 is off.")
    presence_penalty: float | None = Field(default=None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float | None = Field(default=None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    repetition_penalty: float | None = Field(
        default=None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY, description="vLLM's; 1 is none."
    )
    logit_bias: dict[TokenKey, Bias] | None = Field(
        default=None,
        max_length=MAX_TOKEN_LIST,
        description="Token id -> bias, -100 to 100.",
        json_schema_extra=only_token_keys,
    )
    allowed_token_ids: list[TokenId] | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_TOKEN_LIST,
        description="vLLM's: only these may be sampled.",
    )
    bad_words: list[BadWord] | None = Field(
        default=None, max_length=MAX_BAD_WORDS, description="vLLM's: words the output may not hold."
    )
    stop_token_ids: list[TokenId] | None = Field(
        default=None, max_length=MAX_TOKEN_LIST, description="vLLM's: ids that end the output."
    )
    return_token_ids: bool | None = Field(
        default=False, description="vLLM's: the answer carries the prompt's and the output's token ids."
    )
    return_tokens_as_token_ids: bool = Field(
        default=False, description="vLLM's: logprobs name each token `token_id:<id>` instead of its text."
    )
    skip_special_tokens: bool = Field(default=True, description="False keeps special tokens in the text.")
    add_special_tokens: bool | None = Field(
        default=None,
        description="Add BOS and the like to the prompt; default true for completions, false "
        "for chat (the template adds its own).",
    )
    truncate_prompt_tokens: int | None = Field(
        default=None, ge=1, description="Keep only the prompt's last this many tokens."
    )

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

    @property
    def top_logprobs_asked(self) -> int | None:
        """How many alternatives each token's logprobs list; None: no logprobs asked."""
        return None

    def _job(self, *, max_tokens: int | None, **input: Any) -> JobCreate:
        fields: dict[str, Any] = {
            "model": self.model,
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop": self.stop,
            "priority": self.priority,
            "timeout_s": self.timeout_s,
            "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens,
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty or 0.0,
            "frequency_penalty": self.frequency_penalty or 0.0,
            "repetition_penalty": self.repetition_penalty,
            "logit_bias": self.logit_bias,
            "allowed_token_ids": self.allowed_token_ids,
            "bad_words": self.bad_words,
            "stop_token_ids": self.stop_token_ids,
            "logprobs": self.top_logprobs_asked,
            "skip_special_tokens": self.skip_special_tokens,
            "add_special_tokens": self.add_special_tokens,
            "truncate_prompt_tokens": self.truncate_prompt_tokens,
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

    logprobs: int | None = Field(
        default=None,
        ge=0,
        le=MAX_LOGPROBS,
        description="Each token's log probability and its this many likeliest alternatives'.",
    )

    @field_validator("logprobs", mode="before")
    @classmethod
    def _logprobs_count(cls, value: Any) -> Any:
        """`false` (what clients send for "none") is none; `true` is not a count."""
        if value is True:
            raise ValueError(f"logprobs is a count of alternatives here, 0 to {MAX_LOGPROBS}, not true")
        return None if value is False else value

    @property
    def top_logprobs_asked(self) -> int | None:
        return self.logprobs

    @model_validator(mode="after")
    def _no_chat_fields(self) -> CompletionCreate:
        for name, value in (self.model_extra or {}).items():
            if name in CHAT_ONLY and value not in CHAT_ONLY[name]:
                raise ValueError(f"{name!r} applies only to /v1/chat/completions; leave it out")
        return self

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

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionCreate:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self

    @property
    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def to_job(self) -> JobCreate:
        return self._job(
            messages=[m.to_chat() for m in self.messages],
            max_tokens=self.max_completion_tokens or self.max_tokens,
            grammar=self.output_grammar(),
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
            chat_template_kwargs=self.chat_template_kwargs,
        )
