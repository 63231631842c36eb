"""Request bodies of the OpenAI-compatible endpoints, in OpenAI's own shapes (the responses' are
`app.api.openai_answers`).

A request translates to its jobs, one per choice (`app.api.openai_choices`; `to_job` for a request of
one choice). Fields of OpenAI's API (and vLLM's extensions) that would change the answer and that
Conveyor does not implement (beam search, ...) are refused with 422 rather than silently ignored
(`UNSUPPORTED`); the rest of OpenAI's bookkeeping fields (`user`, `metadata`, `store`, ...) are
accepted and ignored.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetJsonSchemaHandler,
    ValidationError,
    field_validator,
    model_validator,
)

from app.api.openai_grammar import (
    ResponseFormat,
    StructuredOutputs,
    choice_grammar,
    response_format_grammar,
    schema_grammar,
    structured_grammar,
)
from app.api.schemas import (
    BadWord,
    Bias,
    JobCreate,
    Priority,
    TokenId,
    TokenKey,
    checked_temperature,
    only_token_keys,
    temperature_schema,
)
from app.core.errors import InvalidRequest
from app.core.grammar import Grammar, grammar_problem
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

# Several choices are several jobs (app/api/openai_choices.py), each admitted and charged as one, and
# the request holds them all open: n is capped as vLLM's own benchmarks use it (up to 16 samples), a
# request's prompts and its choices (prompts x n) at a size one answer carries comfortably.
MAX_N = 16
MAX_PROMPTS = 64
MAX_CHOICES = 64

# A completions request's prompts: strings, or token ids (one list, or a list of lists), none empty.
Prompts = Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)]
TokenPrompt = Annotated[list[TokenId], Field(min_length=1)]
TokenPrompts = Annotated[list[TokenPrompt], Field(min_length=1, max_length=MAX_PROMPTS)]

# Fields OpenAI defines that Conveyor does not implement: accepted only with these neutral values.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "echo": (None, False),  # on chat completions; a completion's is implemented
    "suffix": (None, ""),
    "best_of": (None, 1),
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
    "tools": (None, []),
    "tool_choice": (None, "none"),
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
    n: int | None = Field(
        default=None,
        ge=1,
        le=MAX_N,
        description="Choices per prompt, each a job of its own (with a seed: seeds derived from it).",
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
        """The one job of a request for one choice (a batch's line); InvalidRequest for what a job
        cannot take, `n` over 1 or several prompts included."""
        raise NotImplementedError

    def output_grammar(self) -> Grammar | None:
        """The grammar the answer is constrained to, checked (InvalidRequest naming the field and the
        engine's problem); None for free text."""
        asked = {
            name: grammar
            for name, grammar in (
                ("response_format", response_format_grammar(self.response_format)),
                ("structured_outputs", structured_grammar(self.structured_outputs)),
                ("guided_json", schema_grammar(self.guided_json)),
                (
                    "guided_regex",
                    Grammar("regex", self.guided_regex) if self.guided_regex is not None else None,
                ),
                ("guided_choice", choice_grammar(self.guided_choice)),
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
        if (self.n or 1) > 1:
            raise InvalidRequest(f"n is {self.n}: one choice, one job here")
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


class CompletionCreate(OpenAIRequest):
    model_config = ConfigDict(
        extra="allow",
        json_schema_extra={"examples": [{"model": "SmolLM2-135M-Instruct", "prompt": "Once upon a time"}]},
    )

    prompt: str | Prompts | TokenPrompt | TokenPrompts = Field(
        description=f"A prompt, or up to {MAX_PROMPTS}: strings, one token-id list, or token-id lists.",
    )
    echo: bool | None = Field(
        default=False, description="Each text starts with its prompt; with logprobs, the prompt's too."
    )

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, prompt: Any) -> Any:
        """The schema's rules, with one message that names them."""
        if isinstance(prompt, list) and not (prompt and all(isinstance(p, int) for p in prompt)):
            if not 1 <= len(prompt) <= MAX_PROMPTS or any(p in ("", []) for p in prompt):
                raise ValueError(f"prompt holds 1 to {MAX_PROMPTS} prompts, none empty")
        return prompt

    def prompts(self) -> list[str | list[int]]:
        """The prompts, in order: strings or token-id lists."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]  # type: ignore[list-item]
        return list(self.prompt)  # type: ignore[arg-type]

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
        if len(self.prompts()) > 1 or self.echo:
            raise InvalidRequest(f"{'echo' if self.echo else 'prompt'}: one choice, one plain prompt here")
        return self.job_for(self.prompts()[0])

    def job_for(self, prompt: str | list[int]) -> JobCreate:
        """The job of one of its prompts (echo with logprobs: the prompt's logprobs too)."""
        given = {"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": prompt}
        echoed = self.logprobs if self.echo else None
        return self._job(
            **given, max_tokens=self.max_tokens, grammar=self.output_grammar(), prompt_logprobs=echoed
        )
