"""Request and response bodies of the public API."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    field_validator,
    model_validator,
)

from app.api.tool_schemas import MAX_TOOLS, MessageToolCall, ToolDefinition, check_tools
from app.core.grammar import Grammar, grammar_problem
from app.core.keys import PRIORITIES, PRIORITY_ALIASES
from app.core.sampling import (
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    MAX_TOKEN_LIST,
    MAX_TOP_K,
    MIN_REPETITION_PENALTY,
    MIN_TEMPERATURE,
    MIN_TOP_P,
    SamplingParams,
    temperature_problem,
)

# The classes of app.core.keys.PRIORITIES, served in this order; an alias is stored as its class.
Priority = Annotated[
    Literal["realtime", "high", "normal", "batch"],
    BeforeValidator(lambda v: PRIORITY_ALIASES.get(v, v) if isinstance(v, str) else v),
    Field(description=f"One of {', '.join(PRIORITIES)} (served in that order); `low` means `batch`."),
]


def temperature_schema(schema: dict[str, Any]) -> None:
    """The temperature rule as the schema states it: 0, or MIN_TEMPERATURE to MAX_TEMPERATURE. A
    client (or a fuzzer) generating from the schema then never sends a value in between, which the
    validator refuses (`checked_temperature`); a nullable field keeps its null branch."""
    rule = [
        {"type": "number", "const": 0},
        {"type": "number", "minimum": MIN_TEMPERATURE, "maximum": MAX_TEMPERATURE},
    ]
    if "anyOf" in schema:
        schema["anyOf"] = rule + [branch for branch in schema["anyOf"] if branch.get("type") != "number"]
        return
    for key in ("type", "minimum", "maximum"):
        schema.pop(key, None)
    schema["anyOf"] = rule


def checked_temperature(value: float) -> float:
    """0 (greedy) or at least MIN_TEMPERATURE: between them float32 sampling breaks (app/core/sampling.py)."""
    if 0 < value < MIN_TEMPERATURE:
        raise ValueError(temperature_problem(value))
    return value


# A token id, and OpenAI's logit_bias: a token id as a JSON key (digits) to a bias.
TokenId = Annotated[int, Field(ge=0, le=MAX_TOP_K)]
TokenKey = Annotated[str, StringConstraints(pattern=r"^[0-9]{1,10}$")]
Bias = Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]
BadWord = Annotated[str, Field(min_length=1, max_length=256)]


def only_token_keys(schema: dict[str, Any]) -> None:
    """logit_bias as the schema states it: keys other than token ids are refused, not merely
    unconstrained (JSON Schema's patternProperties alone lets any other key through)."""
    for branch in schema.get("anyOf", [schema]):
        if branch.get("type") == "object":
            branch["additionalProperties"] = False


# apply_chat_template's own arguments and the template's input: a request's chat_template_kwargs
# may add variables for the template, never set these.
TEMPLATE_ARGUMENTS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool"]
    content: str
    tool_calls: list[MessageToolCall] | None = Field(
        default=None, description="An assistant's: the tools it called (OpenAI's shape)."
    )
    tool_call_id: str | None = Field(
        default=None, max_length=256, description="A `tool` message's: the call it answers."
    )

    @model_validator(mode="after")
    def _tool_fields_by_role(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError(
                "a tool message, and only a tool message, names the call it answers (tool_call_id)"
            )
        return self

    def for_template(self) -> dict[str, Any]:
        """As the chat template reads it: only the keys it has (templates test `'tool_calls' in m`)."""
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [call.for_template() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class JobCreate(BaseModel):
    """A generation job: either a raw `prompt` or chat `messages` (rendered by the model's template)."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "messages": [{"role": "user", "content": "What is the capital of France?"}],
                    "max_tokens": 32,
                    "temperature": 0,
                }
            ]
        },
    )

    model: str | None = Field(default=None, description="Model name; the configured default when omitted.")
    prompt: str | None = Field(default=None, description="Raw completion prompt.")
    prompt_token_ids: list[TokenId] | None = Field(
        default=None, min_length=1, description="The prompt as token ids, instead of `prompt` (vLLM's)."
    )
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[ToolDefinition] | None = Field(
        default=None,
        max_length=MAX_TOOLS,
        description="With messages: functions the chat template tells the model it may call (OpenAI's "
        "shape). See docs/structured-outputs.md#tools.",
    )
    max_tokens: Annotated[int, Field(ge=1)] | None = Field(
        default=None, description="Tokens to generate at most; the server's default when omitted."
    )
    # Left out (None), temperature, top_p, top_k, min_p and repetition_penalty take the model's
    # generation_config.json values, else 1, 1, 0, 0 and 1 (as vLLM's `--generation-config auto`).
    temperature: float | None = Field(
        default=None,
        ge=0.0,
        le=MAX_TEMPERATURE,
        description=f"0 means greedy; otherwise {MIN_TEMPERATURE:g} to {MAX_TEMPERATURE:g}. Left out: "
        "the model's generation_config.json value, else 1.",
        json_schema_extra=temperature_schema,
    )
    top_p: float | None = Field(
        default=None,
        ge=MIN_TOP_P,
        le=1.0,
        description="Left out: the model's generation_config.json value, else 1.",
    )
    top_k: int | None = Field(
        default=None,
        ge=0,
        le=MAX_TOP_K,
        description="0 disables the top-k cut. Left out: the model's generation_config.json value, else 0.",
    )
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    min_p: float | None = Field(
        default=None,
        ge=0.0,
        le=1.0,
        description="Drop tokens less likely than min_p x the likeliest (vLLM's). Left out: the model's "
        "generation_config.json value, else 0.",
    )
    presence_penalty: float = Field(
        default=0.0,
        ge=-MAX_PENALTY,
        le=MAX_PENALTY,
        description="Subtracted from the logit of each token the output already holds (OpenAI's).",
    )
    frequency_penalty: float = Field(
        default=0.0,
        ge=-MAX_PENALTY,
        le=MAX_PENALTY,
        description="Subtracted from a token's logit per time the output holds it (OpenAI's).",
    )
    repetition_penalty: float | None = Field(
        default=None,
        ge=MIN_REPETITION_PENALTY,
        le=MAX_REPETITION_PENALTY,
        description="Divides a positive (multiplies a negative) logit of each token in the prompt or "
        "output (vLLM's, as transformers defines it); 1 is none. Left out: the model's "
        "generation_config.json value, else 1.",
    )
    logit_bias: dict[TokenKey, Bias] | None = Field(
        default=None,
        max_length=MAX_TOKEN_LIST,
        description=f"Token id -> added to its logit, -{MAX_LOGIT_BIAS:g} to {MAX_LOGIT_BIAS:g} (OpenAI's).",
        json_schema_extra=only_token_keys,
    )
    allowed_token_ids: list[TokenId] | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_TOKEN_LIST,
        description="Only these tokens may be sampled (vLLM's).",
    )
    bad_words: list[BadWord] | None = Field(
        default=None,
        max_length=MAX_BAD_WORDS,
        description="Words the output may not contain, as token sequences with and without a leading "
        "space (vLLM's).",
    )
    stop_token_ids: list[TokenId] | None = Field(
        default=None,
        max_length=MAX_TOKEN_LIST,
        description="Token ids that end the output as end-of-sequence does, left out of the text (vLLM's).",
    )
    logprobs: int | None = Field(
        default=None,
        ge=0,
        le=MAX_LOGPROBS,
        description="Each token event carries the token's log probability and its this many likeliest "
        "alternatives', from the model's logits before any sampling control (vLLM's raw logprobs).",
    )
    prompt_logprobs: int | None = Field(
        default=None,
        ge=0,
        le=MAX_LOGPROBS,
        description="The first token event carries `prompt_logprobs`: each prompt token's log probability "
        "given the tokens before it, and this many likeliest alternatives' (the first token has none).",
    )
    stop: list[str] | str | None = Field(default=None, description="Stop strings, excluded from the text.")
    grammar: Grammar | None = Field(
        default=None,
        description="Structured output: the text is constrained to this grammar (`json_schema`: the "
        "schema as JSON text; `regex`; `choice`: a JSON list of strings; `lark`) and ends once it is "
        "complete. Refused (422) when the engine cannot compile it. See docs/structured-outputs.md.",
    )
    priority: Priority = "normal"
    timeout_s: float | None = Field(
        default=None,
        gt=0,
        description="Seconds the job may wait in the queue; not started by then, it expires. "
        "Refused at once (429) when the predicted wait is already longer.",
    )
    ignore_eos: bool = Field(default=False, description="Generate exactly max_tokens (for benchmarks).")
    min_tokens: int = Field(
        default=0,
        ge=0,
        description="End of sequence cannot end the job before this many tokens (a stop string still "
        "can). At most max_tokens.",
    )
    skip_special_tokens: bool = Field(
        default=True, description="Leave special tokens out of the text (vLLM's); false keeps them."
    )
    add_special_tokens: bool | None = Field(
        default=None,
        description="Add the tokenizer's special tokens (BOS, ...) to the prompt (vLLM's); default true "
        "for a prompt, false for messages (the chat template adds its own).",
    )
    truncate_prompt_tokens: int | None = Field(
        default=None, ge=1, description="Keep only the prompt's last this many tokens (vLLM's)."
    )
    add_generation_prompt: bool = Field(
        default=True,
        description="With messages: end the rendered chat with the template's generation prompt (vLLM's).",
    )
    continue_final_message: bool = Field(
        default=False,
        description="With messages: leave the final message open, so the answer continues it (vLLM's); "
        "needs add_generation_prompt false.",
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None,
        description="With messages: more variables for the chat template (vLLM's), such as "
        "`enable_thinking`.",
    )
    # Webhooks (app/webhooks/): signed POSTs of the job's events to this URL.
    callback_url: str | None = Field(
        default=None,
        max_length=2048,
        description="http(s) URL that receives the job's events, signed as Standard Webhooks says. "
        "Refused (422 callback_url_refused) when it reaches a private, loopback or link-local address.",
    )
    callback_events: list[Literal["started", "token", "completed", "failed"]] | None = Field(
        default=None,
        min_length=1,
        description="Which events to send; default started, completed, failed (`token`: batches of "
        "tokens, at most one request per 500 ms).",
    )

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value: float | None) -> float | None:
        return None if value is None else checked_temperature(value)

    def sampling(
        self, defaults: Mapping[str, Any], bad_words: tuple[tuple[int, ...], ...] = ()
    ) -> SamplingParams:
        """The job's sampling values, each one left out taken from `defaults` (the model's
        generation_config.json); `bad_words`: the request's words as token sequences (the API
        tokenizes them with the model's tokenizer)."""
        given: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
        }
        chosen = {name: defaults.get(name) if value is None else value for name, value in given.items()}
        return SamplingParams(
            **{name: value for name, value in chosen.items() if value is not None},
            seed=self.seed,
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=tuple(sorted((int(k), float(b)) for k, b in (self.logit_bias or {}).items())),
            allowed_token_ids=None if self.allowed_token_ids is None else tuple(self.allowed_token_ids),
            bad_words=bad_words,
            stop_token_ids=tuple(self.stop_token_ids or ()),
        )

    @field_validator("grammar")
    @classmethod
    def _compiles(cls, grammar: Grammar | None) -> Grammar | None:
        problem = None if grammar is None else grammar_problem(grammar)
        if problem is not None:
            raise ValueError(f"the grammar cannot be compiled: {problem}")
        return grammar

    @model_validator(mode="after")
    def _grammar_ends_it(self) -> JobCreate:
        # The grammar decides where the text ends: these two would fight it.
        if self.grammar is not None and (self.ignore_eos or self.min_tokens):
            raise ValueError("ignore_eos and min_tokens cannot be used with a grammar (structured output)")
        return self

    @model_validator(mode="after")
    def _one_input(self) -> JobCreate:
        given = [self.prompt, self.prompt_token_ids, self.messages]
        if sum(value is not None for value in given) != 1:
            raise ValueError("give exactly one of 'prompt', 'prompt_token_ids' or 'messages'")
        if self.callback_events is not None and self.callback_url is None:  # Webhooks
            raise ValueError("callback_events needs a callback_url")
        if self.messages is None:  # the chat fields, at anything but their defaults
            chat_only = {
                "add_generation_prompt": not self.add_generation_prompt,
                "continue_final_message": self.continue_final_message,
                "chat_template_kwargs": bool(self.chat_template_kwargs),
            }
            given = [name for name, set_ in chat_only.items() if set_]
            if given:
                raise ValueError(f"{given[0]} applies only to 'messages', not to a 'prompt'")
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("continue_final_message needs add_generation_prompt set to false")
        if self.tools:
            if self.messages is None:
                raise ValueError("tools applies only to 'messages', not to a 'prompt'")
            check_tools(self.tools)
        reserved = sorted(set(self.chat_template_kwargs or {}) & TEMPLATE_ARGUMENTS)
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {reserved[0]!r}: it is the server's")
        return self

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class InferenceRequest(JobCreate):
    stream: bool = Field(default=False, description="Answer with the job's server-sent events.")


class JobUrls(BaseModel):
    self: str
    events: str


class JobAccepted(BaseModel):
    id: str
    status: str
    model: str | None = Field(default=None, description="The model that serves it (a route's choice).")
    route: str | None = Field(default=None, description="The route it was sent through, if any.")
    urls: JobUrls


class ErrorBody(BaseModel):
    error: dict[str, Any]


class Health(BaseModel):
    status: str
    checks: dict[str, Any] = Field(default_factory=dict)
