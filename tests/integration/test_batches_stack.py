"""A batch through the whole pipeline with the official `openai` client: its output lines, in input
order, hold the same greedy answers the same requests get one by one (fp32 tiny model), and a line
the API would refuse is answered in the error file with the refusal."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

MAX_TOKENS = 8


@pytest.fixture()
def oai(stack) -> Iterator[openai.OpenAI]:  # type: ignore[no-untyped-def]
    with openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0, timeout=60) as client:
        yield client


def run_batch(oai: openai.OpenAI, endpoint: str, lines: list[dict[str, Any]]) -> Any:
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = oai.files.create(file=("requests.jsonl", content), purpose="batch")
    batch = oai.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h")  # type: ignore[arg-type]
    deadline = time.monotonic() + 300
    while batch.status not in ("completed", "failed", "cancelled", "expired"):
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch.request_counts}"
        time.sleep(0.2)
        batch = oai.batches.retrieve(batch.id)
    return batch


def read_lines(oai: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    assert file_id is not None
    return [json.loads(line) for line in oai.files.content(file_id).text.splitlines()]


def test_a_chat_batch_answers_as_its_requests_one_by_one(oai: openai.OpenAI) -> None:
    bodies = [
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": f"Tell me about the number {i}"}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
        }
        for i in range(20)
    ]
    lines = [
        {"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions", "body": b}
        for i, b in enumerate(bodies)
    ]
    too_long = {**bodies[0], "max_tokens": 100_000}
    lines.insert(
        7, {"custom_id": "too-long", "method": "POST", "url": "/v1/chat/completions", "body": too_long}
    )
    batch = run_batch(oai, "/v1/chat/completions", lines)
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (
        21,
        20,
        1,
    )
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at

    output = read_lines(oai, batch.output_file_id)
    assert [line["custom_id"] for line in output] == [f"q{i}" for i in range(20)], "input order"
    for line, body in zip(output, bodies, strict=True):
        assert line["error"] is None and line["response"]["status_code"] == 200
        answer = line["response"]["body"]
        assert answer["object"] == "chat.completion" and answer["usage"]["completion_tokens"] > 0
        alone = oai.chat.completions.create(**body)
        assert answer["choices"][0]["message"]["content"] == alone.choices[0].message.content
        assert answer["choices"][0]["finish_reason"] == alone.choices[0].finish_reason

    (error,) = read_lines(oai, batch.error_file_id)
    assert error["custom_id"] == "too-long" and error["response"]["status_code"] == 422
    assert error["response"]["body"]["error"]["code"] == "max_tokens_exceeded"


def test_a_completions_batch(oai: openai.OpenAI) -> None:
    prompts = ["The quick brown fox", "Once upon a time", "In the beginning"]
    lines = [
        {
            "custom_id": f"c{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "tiny", "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0},
        }
        for i, p in enumerate(prompts)
    ]
    batch = run_batch(oai, "/v1/completions", lines)
    assert batch.status == "completed" and batch.error_file_id is None
    output = read_lines(oai, batch.output_file_id)
    for line, prompt in zip(output, prompts, strict=True):
        alone = oai.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert line["response"]["body"]["choices"][0]["text"] == alone.choices[0].text
        assert line["response"]["body"]["object"] == "text_completion"


def test_the_cli_submits_waits_and_downloads(stack, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from typer.testing import CliRunner

    from app.cli import cli

    lines = [
        {
            "custom_id": f"c{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": p, "max_tokens": 4},
        }
        for i, p in enumerate(["Hello", "World"])
    ]
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps(line) + "\n" for line in lines))
    runner = CliRunner()
    submitted = runner.invoke(
        cli, ["batch", "submit", str(requests), "--endpoint", "/v1/completions", "--url", stack.url]
    )
    assert submitted.exit_code == 0, submitted.output
    batch_id = submitted.stdout.strip()
    assert batch_id.startswith("batch_")
    waited = runner.invoke(cli, ["batch", "status", batch_id, "--wait", "--url", stack.url])
    assert waited.exit_code == 0 and "completed: 2 completed, 0 failed of 2" in waited.stdout
    out = tmp_path / "out.jsonl"
    assert (
        runner.invoke(cli, ["batch", "download", batch_id, "--out", str(out), "--url", stack.url]).exit_code
        == 0
    )
    assert [json.loads(x)["custom_id"] for x in out.read_text().splitlines()] == ["c0", "c1"]
    assert runner.invoke(cli, ["batch", "download", batch_id, "--errors", "--url", stack.url]).exit_code == 1
