"""The official `openai` client against Conveyor: the same jobs, the same greedy text, OpenAI's shapes."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from clients import submit, wait

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The quick brown fox"
MAX_TOKENS = 24


@pytest.fixture()
def oai(stack) -> Iterator[openai.OpenAI]:  # type: ignore[no-untyped-def]
    with openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0, timeout=60) as client:
        yield client


def job_of(client, openai_id: str) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """The Conveyor job behind an OpenAI id (`chatcmpl-<job id>`, `cmpl-<job id>`)."""
    return wait(client, openai_id.split("-", 1)[1])


def reference(stack, **body: Any) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    with stack.client() as client:
        job = wait(client, submit(client, temperature=0, max_tokens=MAX_TOKENS, **body)["id"])
    assert job["status"] == "succeeded", job
    return job


def assert_usage(usage: Any, job: dict[str, Any]) -> None:
    assert usage.prompt_tokens == job["usage"]["prompt_tokens"] > 0
    assert usage.completion_tokens == job["usage"]["completion_tokens"] > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_chat_completion_equals_the_job_streamed_or_not(stack, oai):  # type: ignore[no-untyped-def]
    job = reference(stack, messages=MESSAGES)
    whole = oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    assert whole.object == "chat.completion" and whole.model == "tiny"
    assert whole.id.startswith("chatcmpl-") and abs(whole.created - time.time()) < 120
    (choice,) = whole.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.message.content == job["text"]
    assert choice.finish_reason == job["finish_reason"]
    assert_usage(whole.usage, job)
    with stack.client() as client:
        assert job_of(client, whole.id)["text"] == job["text"], "the completion is a job, pollable as one"

    chunks = list(
        oai.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_completion_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert chunks[0].choices[0].delta.role == "assistant"
    *deltas, last, usage = chunks
    assert "".join(c.choices[0].delta.content or "" for c in deltas) == job["text"]
    assert [c.choices[0].finish_reason for c in deltas] == [None] * len(deltas)
    assert last.choices[0].finish_reason == job["finish_reason"]
    assert usage.choices == [] and all(c.usage is None for c in chunks[:-1])
    assert_usage(usage.usage, job)


def test_completion_equals_the_job_streamed_or_not(stack, oai):  # type: ignore[no-untyped-def]
    job = reference(stack, prompt=PROMPT)
    whole = oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-")
    assert whole.choices[0].text == job["text"]
    assert whole.choices[0].finish_reason == job["finish_reason"]
    assert_usage(whole.usage, job)

    chunks = list(
        oai.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *texts, last, usage = chunks
    assert {c.object for c in chunks} == {"text_completion"}
    assert "".join(c.choices[0].text for c in texts) == job["text"]
    assert last.choices[0].finish_reason == job["finish_reason"]
    assert_usage(usage.usage, job)
    plain = list(
        oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True)
    )
    assert all(c.usage is None for c in plain), "usage only when stream_options asks for it"
    assert "".join(c.choices[0].text for c in plain) == job["text"]


def test_models_list_the_served_model(oai):  # type: ignore[no-untyped-def]
    models = oai.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert models[0].object == "model" and models[0].owned_by == "conveyor" and models[0].created > 0
    assert oai.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as caught:
        oai.models.retrieve("no-such-model")
    assert caught.value.code == "model_not_found"


def test_max_completion_tokens_and_conveyor_extras(oai):  # type: ignore[no-untyped-def]
    answer = oai.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_completion_tokens=5,
        extra_body={"ignore_eos": True, "priority": "high"},
    )
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage is not None and answer.usage.completion_tokens == 5


@pytest.mark.parametrize(
    ("extra", "where"),
    [
        ({"n": 17}, "n"),
        ({"echo": True}, "echo"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
)
def test_what_is_not_implemented_is_refused_clearly(oai, extra, where):  # type: ignore[no-untyped-def]
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, extra_body=extra)
    assert caught.value.code == "invalid_request" and caught.value.type == "invalid_request_error"
    assert where in caught.value.message


def test_n4_with_a_seed_is_reproducible_through_the_client(oai):  # type: ignore[no-untyped-def]
    ask: dict[str, Any] = {"model": "tiny", "prompt": PROMPT, "n": 4, "seed": 2026, "temperature": 1.0}
    ask |= {"max_tokens": 8, "extra_body": {"ignore_eos": True, "return_token_ids": True}}
    first, again = oai.completions.create(**ask), oai.completions.create(**ask)
    assert [c.index for c in first.choices] == [0, 1, 2, 3]
    samples = [c.model_extra["token_ids"] for c in first.choices]
    assert samples == [c.model_extra["token_ids"] for c in again.choices]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({tuple(s) for s in samples}) == 4, "at temperature 1 the four samples differ"
    assert first.usage is not None and first.usage.completion_tokens == 32
    streamed: dict[int, str] = {}
    for chunk in oai.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert streamed == {c.index: c.text for c in first.choices}


def test_several_prompts_and_echo_with_logprobs_through_the_client(oai):  # type: ignore[no-untyped-def]
    ask: dict[str, Any] = {"model": "tiny", "max_tokens": 4, "temperature": 0}
    one = [oai.completions.create(prompt=p, **ask).choices[0].text for p in (PROMPT, "Hello")]
    both = oai.completions.create(prompt=[PROMPT, "Hello"], **ask)
    assert [(c.index, c.text) for c in both.choices] == [(0, one[0]), (1, one[1])]
    echoed = oai.completions.create(prompt=PROMPT, echo=True, logprobs=1, **ask).choices[0]
    assert echoed.text == PROMPT + one[0]
    assert echoed.logprobs is not None and echoed.logprobs.token_logprobs is not None
    assert echoed.logprobs.token_logprobs[0] is None
    assert all(lp <= 0 for lp in echoed.logprobs.token_logprobs[1:])


def test_errors_keep_the_project_code_and_add_openai_type(stack, oai):  # type: ignore[no-untyped-def]
    with pytest.raises(openai.NotFoundError) as caught:
        oai.completions.create(model="no-such-model", prompt="hi")
    assert caught.value.code == "model_not_found" and caught.value.type == "invalid_request_error"
    with stack.client() as client:
        answer = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 100_000})
    assert answer.status_code == 422
    error = answer.json()["error"]
    assert error["code"] == "max_tokens_exceeded" and error["type"] == "invalid_request_error"
    assert error["message"] and error["details"]["limit"] == 1024


def test_the_raw_stream_is_openai_framed_and_ends_with_done(stack):  # type: ignore[no-untyped-def]
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}
    with stack.client() as client, client.stream("POST", "/v1/completions", json=body) as answer:
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in answer.iter_lines() if line and not line.startswith(":")]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2].removeprefix("data: "))["choices"][0]["finish_reason"] in {"stop", "length"}


def test_a_client_that_leaves_a_stream_cancels_its_job(stack, oai):  # type: ignore[no-untyped-def]
    stream = oai.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=480,  # the tiny model's context is 512
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    seen = 0
    for chunk in stream:
        seen += bool(chunk.choices and chunk.choices[0].delta.content)
        if seen == 2:
            break
    stream.close()  # and hang up
    with stack.client() as client:
        job = job_of(client, chunk.id)
    assert job["status"] == "cancelled", job
    assert job["usage"]["completion_tokens"] < 480


def test_a_job_cancelled_mid_stream_ends_it_with_an_error(stack, oai):  # type: ignore[no-untyped-def]
    stream = oai.completions.create(
        model="tiny", prompt="x", max_tokens=480, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    first = next(iter(stream))
    with stack.client() as client:
        assert client.post(f"/v1/jobs/{first.id.removeprefix('cmpl-')}/cancel").status_code == 200
    with pytest.raises(openai.APIError) as caught:
        for _ in stream:
            pass
    assert caught.value.code == "cancelled" and "cancelled" in caught.value.message


def test_a_job_that_cannot_start_within_its_timeout_is_a_429_not_a_server_error(stack):  # type: ignore[no-untyped-def]
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "timeout_s": 5e-324}
    with stack.client() as client:
        answer = client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 429
    error = answer.json()["error"]
    # Refused at once when the queue already predicts a wait, else expired before it started.
    assert error["code"] in ("deadline_unmeetable", "expired")
    assert error["type"] == "rate_limit_error"
    assert int(answer.headers["retry-after"]) >= 1  # every 429 says when to come back
