"""The OpenAI request bodies as benchmark tools and the official client send them, turned into jobs."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from app.api.openai_schemas import UNSUPPORTED, ChatCompletionCreate, CompletionCreate

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
    [{"length_penalty": 1.2}, {"guided_regex": "a+"}, {"echo": True}, {"use_beam_search": True}, {"n": 2}],
)
def test_what_would_change_the_answer_is_refused(extra):  # type: ignore[no-untyped-def]
    with pytest.raises(ValidationError) as caught:
        CompletionCreate.model_validate({"prompt": "hi", **extra})
    assert next(iter(extra)) in str(caught.value)


def test_the_compatibility_table_names_every_refused_field():
    table = (Path(__file__).resolve().parents[2] / "docs" / "openai.md").read_text()
    missing = [name for name in UNSUPPORTED if f"`{name}`" not in table]
    assert not missing, f"docs/openai.md does not list {missing}"
