"""Bodies of /tokenize and /detokenize, in vLLM's shapes (its TokenizeRequest and DetokenizeRequest)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_validator

from app.api.schemas import ChatMessage


class TokenizeCreate(BaseModel):
    """Either a `prompt` or chat `messages` (rendered with the model's chat template first)."""

    model_config = ConfigDict(
        extra="ignore", json_schema_extra={"examples": [{"model": "smollm2-135m", "prompt": "Hello"}]}
    )

    model: str | None = Field(default=None, description="Model name; the configured default when omitted.")
    prompt: str | None = Field(default=None, description="Text to tokenize.")
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_generation_prompt: StrictBool = Field(
        default=True, description="With `messages`: end with the assistant's turn, as a chat request does."
    )
    add_special_tokens: StrictBool | None = Field(
        default=None,
        description="Add the tokenizer's special tokens (BOS...). Unset: true for a prompt, false for "
        "messages (the chat template writes its own), as vLLM does.",
    )

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeCreate:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        return self


class TokenizeResult(BaseModel):
    count: int = Field(description="How many tokens.")
    max_model_len: int = Field(description="The model's context length in tokens.")
    tokens: list[int]


class DetokenizeCreate(BaseModel):
    model_config = ConfigDict(extra="ignore", json_schema_extra={"examples": [{"tokens": [19556, 905]}]})

    model: str | None = Field(default=None, description="Model name; the configured default when omitted.")
    tokens: list[StrictInt] = Field(max_length=1_000_000, description="Token ids of the model's vocabulary.")


class DetokenizeResult(BaseModel):
    prompt: str
