"""Tools with the official `openai` client, against the API in process whose jobs the in-process
pipeline generates on the CPU: on SmolLM2 (in bf16, as `auto` serves it on a CPU with native bf16:
what is asserted is the answers' shape, not `generate`'s numbers), a round trip (request ->
tool_calls -> tool message -> answer) with tool_choice `required` and a named function, streamed and
not; on the tiny random model sampled at temperature 1, forced calls that always parse; and the
422s as a client sees them."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar
from unittest import mock

import openai
import pytest
import redis as redis_lib
import torch
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from app.api import batchfeed
from app.api.app import create_app
from app.core.keys import Keys
from tests.stageharness import Pipeline, build
from tests.tiny import make_tiny_model
from tests.tinyapi import forget_namespace, tiny_settings

T = TypeVar("T")
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
        },
    },
}
TOOLS = [TIME, WEATHER]
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
REPORT = json.dumps({"city": "Paris", "temperature": 21, "sky": "sunny"})


def serve(
    redis_url: str, path: Path, dtype: torch.dtype = torch.float32
) -> Iterator[tuple[openai.OpenAI, Pipeline]]:
    """The API over the model at `path` and, in the same namespace, the pipeline (in `dtype`) that
    generates what it submits."""
    settings = tiny_settings(redis_url, path, auth="none")
    redis = redis_lib.Redis.from_url(redis_url)
    redis.zadd(Keys(settings.namespace).workers("tiny", 0), {"w0": time.time() + 3600})
    pipeline = build(redis, path, namespace=settings.namespace, dtype=dtype)
    try:
        with mock.patch.object(batchfeed, "FEED_INTERVAL_S", 0.05), TestClient(create_app(settings)) as http:
            yield (
                openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0),
                pipeline,
            )
    finally:
        forget_namespace(redis_url, settings.namespace)


@pytest.fixture(scope="module")
def served(redis_url: str, smollm2_dir: Path) -> Iterator[tuple[openai.OpenAI, Pipeline]]:
    yield from serve(redis_url, smollm2_dir, torch.bfloat16)


@pytest.fixture(scope="module")
def tiny(
    redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[openai.OpenAI, Pipeline]]:
    """The tiny random model, with the context a prompt of tools takes in its byte-level tokens."""
    yield from serve(redis_url, make_tiny_model(tmp_path_factory.mktemp("tools") / "tiny", context=4096))


def generated(pipeline: Pipeline, *calls: Callable[[], T]) -> tuple[list[T], list[list[int]]]:
    """Each of `calls` (a request) on a thread of its own, their jobs generated meanwhile as one
    batch; their results in order, and the jobs' prompts (in the order the jobs were queued)."""
    results: list[dict[str, Any]] = [{} for _ in calls]

    def run(call: Callable[[], T], result: dict[str, Any]) -> None:
        try:
            result["value"] = call()
        except Exception as exc:  # raised again in the test's thread
            result["error"] = exc

    threads = [threading.Thread(target=run, args=pair) for pair in zip(calls, results, strict=True)]
    for thread in threads:
        thread.start()
    jobs = pipeline.wait_queued(
        len(calls), timeout_s=60, alive=lambda: all(thread.is_alive() for thread in threads)
    )
    prompts = [json.loads(pipeline.record(job)["prompt_ids"]) for job in jobs]
    if jobs:
        pipeline.dispatch(jobs)
        pipeline.pump()
    for thread in threads:
        thread.join(120)
    for result in results:
        if "error" in result:
            raise result["error"]
    assert len(jobs) == len(calls), f"{len(calls)} requests made {len(jobs)} jobs"
    return [result["value"] for result in results], prompts


def request(client: openai.OpenAI, *, stream: bool, **body: Any) -> Callable[[], dict[str, Any]]:
    """One chat completion, streamed or not, to be made: the message and finish reason it adds up to."""
    body = {"model": "tiny", "tools": TOOLS, "max_completion_tokens": 128, "temperature": 0, **body}

    def call() -> dict[str, Any]:
        if stream:
            return joined(list(client.chat.completions.create(stream=True, **body)))
        choice = client.chat.completions.create(**body).choices[0]
        return {**choice.message.model_dump(exclude_none=True), "finish_reason": choice.finish_reason}

    return call


def ask(
    served: tuple[openai.OpenAI, Pipeline], *, stream: bool, **body: Any
) -> tuple[dict[str, Any], list[int]]:
    """One chat completion, streamed or not: the message and finish reason it adds up to, and the
    prompt its job was given."""
    client, pipeline = served
    (message,), (prompt,) = generated(pipeline, request(client, stream=stream, **body))
    return message, prompt


def joined(chunks: list[Any]) -> dict[str, Any]:
    """A stream's chunks added up as OpenAI's clients add them: content, and each call by its index,
    its id, type and name from its first delta, its arguments the pieces' concatenation."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        (choice,) = chunk.choices
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            if delta.index not in calls:
                assert delta.id and delta.type == "function" and delta.function.name, (
                    "first delta names the call"
                )
                calls[delta.index] = {
                    "id": delta.id,
                    "type": "function",
                    "function": {"name": delta.function.name, "arguments": ""},
                }
            else:
                assert delta.id is None and delta.function.name is None, "later deltas carry arguments only"
            calls[delta.index]["function"]["arguments"] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    message: dict[str, Any] = {"role": "assistant", "finish_reason": finish}
    if content:
        message["content"] = content
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_a_tool_call_round_trip_on_smollm2(served, smollm2_dir, choice, stream):  # type: ignore[no-untyped-def]
    """The forced answer is calls that parse, of the tools asked (the named one), with arguments that
    follow the function's schema; the calls and the tool's result go back in the next request, whose
    prompt shows them to the model, and its answer is text."""
    first, _ = ask(served, stream=stream, messages=QUESTION, tool_choice=choice)
    assert first["finish_reason"] == "tool_calls", first
    assert "content" not in first, first
    calls = first["tool_calls"]
    assert calls and all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    names = [c["function"]["name"] for c in calls]
    assert set(names) <= {"get_weather", "get_time"} and (choice == "required" or names == ["get_weather"])
    for call in calls:
        arguments = json.loads(call["function"]["arguments"])
        assert isinstance(arguments["city"], str), arguments
        if call["function"]["name"] == "get_weather":
            assert arguments["unit"] in ("celsius", "fahrenheit") and set(arguments) == {"city", "unit"}

    results = [{"role": "tool", "tool_call_id": c["id"], "content": REPORT} for c in calls]
    assistant = {"role": "assistant", "content": None, "tool_calls": calls}
    messages = [*QUESTION, assistant, *results]
    second, prompt_ids = ask(
        served, stream=stream, messages=messages, tool_choice="none", max_completion_tokens=24
    )
    assert second["finish_reason"] in ("stop", "length") and second["content"].strip(), second
    assert "tool_calls" not in second

    prompt = AutoTokenizer.from_pretrained(smollm2_dir).decode(prompt_ids)
    assert '"name": "get_weather"' in prompt and "<tools>" in prompt, "the tools are in the system prompt"
    written = {"name": names[0], "arguments": json.loads(calls[0]["function"]["arguments"])}
    assert f"<tool_call>\n{json.dumps(written)}\n</tool_call>" in prompt, "the call, in its turn"
    assert f"<|im_start|>user\n<tool_response>\n{REPORT}\n</tool_response>" in prompt


@pytest.mark.slow
def test_streamed_and_whole_answers_agree(served):  # type: ignore[no-untyped-def]
    """The same greedy request answers the same calls, ids aside, whether streamed or not."""
    whole, _ = ask(served, stream=False, messages=QUESTION, tool_choice="required")
    streamed, _ = ask(served, stream=True, messages=QUESTION, tool_choice="required")

    def without_ids(message: dict[str, Any]) -> dict[str, Any]:
        return {**message, "tool_calls": [{**c, "id": None} for c in message["tool_calls"]]}

    assert without_ids(whole) == without_ids(streamed)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_forced_calls_parse_whatever_a_random_model_samples(tiny, stream):  # type: ignore[no-untyped-def]
    """A random model at temperature 1 writes calls that parse when they are forced: required (one or
    more of the tools) and named (that one), each with arguments that follow its schema."""
    client, pipeline = tiny
    choices = ["required", NAMED, "required", NAMED]
    asked = [
        request(
            client,
            stream=stream,
            messages=QUESTION,
            tool_choice=choice,
            temperature=1.0,
            seed=seed,
            max_completion_tokens=600,
        )
        for seed, choice in enumerate(choices)
    ]
    messages, _ = generated(pipeline, *asked)  # the four at once, one batch
    called = []
    for choice, message in zip(choices, messages, strict=True):
        if message["finish_reason"] == "length":
            continue  # a random model may fill max_tokens inside a string: then nothing is a call
        assert message["finish_reason"] == "tool_calls", message
        called.append(choice)
        for call in message["tool_calls"]:
            arguments = json.loads(call["function"]["arguments"])
            assert isinstance(arguments["city"], str) and len(arguments["city"]) <= 20
            assert choice == "required" or call["function"]["name"] == "get_weather"
            if call["function"]["name"] == "get_weather":
                assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")
    assert "required" in called and NAMED in called, "most answers end by themselves"


def test_auto_streams_the_same_text_it_answers_whole(tiny):  # type: ignore[no-untyped-def]
    """With tools and `auto`, a text that holds no call comes out whole as content, streamed or not."""
    whole, _ = ask(tiny, stream=False, messages=QUESTION, max_completion_tokens=24, temperature=0)
    streamed, _ = ask(tiny, stream=True, messages=QUESTION, max_completion_tokens=24, temperature=0)
    assert whole["content"] and "tool_calls" not in whole, whole
    assert streamed == whole


@pytest.mark.parametrize(
    ("path", "body", "named"),
    [
        ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "a.b"}}]}, "name"),
        ("/v1/chat/completions", {"tools": [WEATHER, WEATHER]}, "defined twice"),
        ("/v1/chat/completions", {"tool_choice": {"type": "function", "function": {"name": "x"}}}, "x"),
        (
            "/v1/chat/completions",
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "another",
        ),
        ("/v1/completions", {"prompt": "a"}, "tools"),
    ],
)
def test_what_cannot_be_served_is_422_naming_it(tiny, path, body, named):  # type: ignore[no-untyped-def]
    client, _ = tiny
    sent = {"model": "tiny", "messages": QUESTION, "tools": TOOLS, "max_tokens": 4, **body}
    if path == "/v1/completions":
        sent.pop("messages")
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        client.post(path.removeprefix("/v1"), body=sent, cast_to=dict)
    assert caught.value.code == "invalid_request" and named in caught.value.message


def test_a_batch_lines_forced_call_is_in_its_output(tiny):  # type: ignore[no-untyped-def]
    """A chat line of the Batch API with a named tool_choice: its job is constrained as the endpoint's
    would be, and its output line carries the call, read in the model's format."""
    client, pipeline = tiny
    body = {"model": "tiny", "messages": QUESTION, "tools": TOOLS, "tool_choice": NAMED, "max_tokens": 300}
    line = {"custom_id": "w", "method": "POST", "url": "/v1/chat/completions", "body": body}
    uploaded = client.files.create(file=("in.jsonl", (json.dumps(line) + "\n").encode()), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    deadline = time.monotonic() + 60
    jobs = pipeline.wait_queued(timeout_s=60)
    assert jobs, "the batch fed no job"
    pipeline.dispatch(jobs)
    pipeline.pump()
    while (done := client.batches.retrieve(batch.id)).status != "completed" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert done.status == "completed" and done.output_file_id, done
    (output,) = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    choice = output["response"]["body"]["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
    assert set(json.loads(call["function"]["arguments"])) == {"city", "unit"}
