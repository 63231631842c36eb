"""The OpenAI request bodies as benchmark tools and the official client send them, turned into jobs."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from app.api.chat_schemas import ChatCompletionCreate
from app.api.openai_schemas import CHAT_ONLY, UNSUPPORTED, CompletionCreate
from app.core.errors import InvalidRequest

STREAM = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
# As guidellm sends them for a fixed output length.
GUIDELLM_COMPLETION = {
    "model": "m",
    "prompt": "hi",
    "max_tokens": 64,
    "ignore_eos": True,
    "stop": None,
    **STREAM,
}
GUIDELLM_CHAT = {
    "model": "m",
    "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    "max_completion_tokens": 64,
    "ignore_eos": True,
    "stop": None,
    **STREAM,
}


@pytest.mark.parametrize(
    ("schema", "body"), [(CompletionCreate, GUIDELLM_COMPLETION), (ChatCompletionCreate, GUIDELLM_CHAT)]
)
def test_guidellm_bodies_become_jobs_of_exactly_max_tokens(schema, body):  # type: ignore[no-untyped-def]
    request = schema.model_validate(body)
    assert request.include_usage and request.continuous_usage
    job = request.to_job()
    assert job.max_tokens == 64 and job.ignore_eos and job.stop_list() == []


def test_max_completion_tokens_wins_over_max_tokens():
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "max_completion_tokens": 7}
    assert ChatCompletionCreate.model_validate(body).to_job().max_tokens == 7
    del body["max_completion_tokens"]
    assert ChatCompletionCreate.model_validate(body).to_job().max_tokens == 5


def test_continuous_usage_only_with_include_usage():
    body = {"prompt": "hi", "stream": True, "stream_options": {"continuous_usage_stats": True}}
    assert not CompletionCreate.model_validate(body).continuous_usage


def test_min_tokens_reaches_the_job_and_is_not_negative():
    assert CompletionCreate.model_validate({"prompt": "hi", "min_tokens": 3}).to_job().min_tokens == 3
    with pytest.raises(ValidationError):
        CompletionCreate.model_validate({"prompt": "hi", "min_tokens": -1})


@pytest.mark.parametrize(
    "extra",
    [
        {"user": "u"},
        {"metadata": {"k": "v"}, "store": False, "service_tier": "auto"},
        {"repetition_penalty": 1.0, "min_p": 0, "logprobs": False},
        {"stream_options": {"include_usage": True, "include_obfuscation": False}},
    ],
)
def test_bookkeeping_and_neutral_values_are_accepted(extra):  # type: ignore[no-untyped-def]
    CompletionCreate.model_validate({"prompt": "hi", **extra}).to_job()


@pytest.mark.parametrize(
    "extra",
    [{"length_penalty": 1.2}, {"prompt_logprobs": 1}, {"best_of": 2}, {"use_beam_search": True}, {"n": 17}],
)
def test_what_would_change_the_answer_is_refused(extra):  # type: ignore[no-untyped-def]
    with pytest.raises(ValidationError) as caught:
        CompletionCreate.model_validate({"prompt": "hi", **extra})
    assert next(iter(extra)) in str(caught.value)


def test_chat_has_no_echo():  # type: ignore[no-untyped-def]
    with pytest.raises(ValidationError, match="echo"):
        ChatCompletionCreate.model_validate({"messages": [{"role": "user", "content": "hi"}], "echo": True})


@pytest.mark.parametrize(
    ("fields", "prompts"),
    [
        ({"prompt": "hi"}, ["hi"]),
        ({"prompt": ["a", "b"]}, ["a", "b"]),
        ({"prompt": [1, 2, 3]}, [[1, 2, 3]]),
        ({"prompt": [[1, 2], [3]]}, [[1, 2], [3]]),
    ],
)
def test_a_completions_prompts_strings_or_token_ids(fields, prompts):  # type: ignore[no-untyped-def]
    assert CompletionCreate.model_validate(fields).prompts() == prompts


@pytest.mark.parametrize("fields", [{"n": 2}, {"prompt": ["a", "b"]}, {"echo": True}])
def test_one_job_of_a_request_for_several_choices_or_echo_is_refused(fields):  # type: ignore[no-untyped-def]
    """A batch's line is one job: what asks for more (or for echo, which it would not show) is refused."""
    request = CompletionCreate.model_validate({"prompt": "hi", **fields})
    with pytest.raises(InvalidRequest, match=next(iter(fields))):
        request.to_job()


def test_the_compatibility_table_names_every_refused_field():
    table = (Path(__file__).resolve().parents[2] / "docs" / "openai.md").read_text()
    missing = [name for name in UNSUPPORTED if f"`{name}`" not in table]
    assert not missing, f"docs/openai.md does not list {missing}"


# vLLM's request fields beyond OpenAI's (its ChatCompletionRequest and CompletionRequest), each of
# which changes the answer or asks for something: every one is implemented (a declared field),
# refused unless neutral (UNSUPPORTED, or CHAT_ONLY on completions), or named here as ignored on
# purpose (docs/openai.md says why). A field vLLM adds lands in none of these and fails this test.
VLLM_CHAT_FIELDS = {
    "best_of", "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty",
    "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
    "spaces_between_special_tokens", "truncate_prompt_tokens", "prompt_logprobs", "allowed_token_ids",
    "bad_words", "echo", "add_generation_prompt", "continue_final_message", "add_special_tokens",
    "documents", "chat_template", "chat_template_kwargs", "mm_processor_kwargs", "media_io_kwargs",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structural_tag",
    "structured_outputs", "guided_decoding_backend", "guided_whitespace_pattern", "priority",
    "request_id", "logits_processors", "return_tokens_as_token_ids", "return_token_ids", "cache_salt",
    "kv_transfer_params", "vllm_xargs", "include_reasoning", "logprobs", "top_logprobs",
    "presence_penalty", "frequency_penalty", "logit_bias", "seed",
}  # fmt: skip
VLLM_COMPLETION_FIELDS = (VLLM_CHAT_FIELDS - {
    "add_generation_prompt", "continue_final_message", "documents", "chat_template",
    "chat_template_kwargs", "mm_processor_kwargs", "media_io_kwargs", "include_reasoning",
    "top_logprobs",
}) | {"prompt_embeds", "suffix"}  # fmt: skip
IGNORED_ON_PURPOSE = {"request_id", "cache_salt", "include_reasoning"}


@pytest.mark.parametrize(
    ("model", "fields"),
    [(ChatCompletionCreate, VLLM_CHAT_FIELDS), (CompletionCreate, VLLM_COMPLETION_FIELDS)],
    ids=["chat", "completions"],
)
def test_no_vllm_field_is_silently_ignored(model, fields):  # type: ignore[no-untyped-def]
    refused = set(UNSUPPORTED) | (set(CHAT_ONLY) if model is CompletionCreate else set())
    unclassified = fields - set(model.model_fields) - refused - IGNORED_ON_PURPOSE
    assert not unclassified, f"vLLM fields neither implemented nor refused: {sorted(unclassified)}"
    table = (Path(__file__).resolve().parents[2] / "docs" / "openai.md").read_text()
    assert all(f"`{name}`" in table for name in fields), "docs/openai.md names every vLLM field"


@pytest.mark.parametrize("model", [ChatCompletionCreate, CompletionCreate], ids=["chat", "completions"])
def test_the_compatibility_table_names_every_field_the_code_takes(model):  # type: ignore[no-untyped-def]
    """Every field a request model declares (implemented) has its row in docs/openai.md's table."""
    table = (Path(__file__).resolve().parents[2] / "docs" / "openai.md").read_text()
    declared = {field.alias or name for name, field in model.model_fields.items()}
    missing = sorted(name for name in declared if f"`{name}`" not in table and f"`{name}." not in table)
    assert not missing, f"docs/openai.md does not list {missing}"
