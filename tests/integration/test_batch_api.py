"""OpenAI's Batch API over the real API app and a real Redis, with the official `openai` client: files
and batches are the tenant's own, the file quota holds, bad lines fail the batch with their errors,
cancel ends it, and the feeder writes each line's job exactly once however it is stopped.

No stage worker runs here: the lines' jobs stay queued (the whole pipeline's answers are checked
against the shared stack in test_batches_stack.py)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import redis as redis_lib
from fastapi.testclient import TestClient

from app.api import batchfeed
from app.api.app import create_app
from app.api.auth import key_digest, new_api_key
from app.core.batchstore import line_job_id
from app.core.config import Settings
from app.core.keys import Keys
from tests.tinyapi import forget_namespace, tiny_settings

KEYS = {"acme": new_api_key(), "other": new_api_key()}


def chat_line(i: int, **body: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": f"Count to {i}"}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0, **body}
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}


def jsonl(lines: list[dict[str, Any]] | list[str]) -> bytes:
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode()


def wait_until(check: Callable[[], Any], timeout_s: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("the condition did not hold in time")


class Api:
    """The app in process (its batch feeder running), and an `openai` client per tenant."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.keys = Keys(settings.namespace)
        self.http = TestClient(create_app(settings))
        self.http.__enter__()
        self.closed = False
        self.clients = {
            tenant: openai.OpenAI(
                base_url="http://testserver/v1", api_key=key, http_client=self.http, max_retries=0
            )
            for tenant, key in KEYS.items()
        }

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.http.__exit__(None, None, None)

    def batch(self, tenant: str, lines: bytes) -> Any:
        client = self.clients[tenant]
        uploaded = client.files.create(file=("in.jsonl", lines), purpose="batch")
        return client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )

    def wait_status(self, tenant: str, batch_id: str, *statuses: str) -> Any:
        return wait_until(
            lambda: (b := self.clients[tenant].batches.retrieve(batch_id)).status in statuses and b
        )


@pytest.fixture()
def start(redis_url: str, tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Api]]:
    monkeypatch.setattr(batchfeed, "FEED_INTERVAL_S", 0.05)
    started: list[Api] = []
    namespace = None

    def make(**overrides: Any) -> Api:
        nonlocal namespace
        fields: dict[str, Any] = {"api_keys": {key_digest(k): t for t, k in KEYS.items()}}
        if namespace is not None:
            fields["namespace"] = namespace  # a restart: the same Redis keys
        api = Api(tiny_settings(redis_url, tiny_model, **(fields | overrides)))
        namespace = api.settings.namespace
        started.append(api)
        return api

    try:
        yield make
    finally:
        for api in started:
            api.close()
        if namespace is not None:
            forget_namespace(redis_url, namespace)


def test_files_and_batches_are_the_tenants_own(start: Callable[..., Api]) -> None:
    api = start()
    acme, other = api.clients["acme"], api.clients["other"]
    uploaded = acme.files.create(file=("in.jsonl", jsonl([chat_line(1)])), purpose="batch")
    assert uploaded.object == "file" and uploaded.purpose == "batch" and uploaded.filename == "in.jsonl"
    assert acme.files.retrieve(uploaded.id).bytes == len(jsonl([chat_line(1)]))
    assert acme.files.content(uploaded.id).content == jsonl([chat_line(1)])
    batch = acme.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "nightly"},
    )
    assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
    assert batch.request_counts is not None and batch.input_file_id == uploaded.id

    for call in (
        lambda: other.files.retrieve(uploaded.id),
        lambda: other.files.content(uploaded.id),
        lambda: other.files.delete(uploaded.id),
        lambda: other.batches.retrieve(batch.id),
        lambda: other.batches.cancel(batch.id),
        lambda: other.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        ),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert other.batches.list().data == []
    second = acme.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    page = acme.batches.list(limit=1)
    assert [b.id for b in page.data] == [second.id] and page.has_more, "newest first"
    assert [b.id for b in acme.batches.list(limit=1, after=second.id).data] == [batch.id]
    assert [b.id for b in acme.batches.list(limit=1)] == [second.id, batch.id], "the client pages on"
    assert acme.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        acme.files.retrieve(uploaded.id)


def test_the_file_quota_refuses_with_429_until_a_file_is_deleted(start: Callable[..., Api]) -> None:
    content = jsonl([chat_line(i) for i in range(4)])  # about 650 bytes
    api = start(batch_file_max_bytes=len(content))  # a tenant's files hold 8 x this at most
    acme, other = api.clients["acme"], api.clients["other"]
    kept = [acme.files.create(file=(f"{n}.jsonl", content), purpose="batch") for n in range(8)]
    with pytest.raises(openai.RateLimitError) as refused:
        acme.files.create(file=("b.jsonl", content), purpose="batch")
    assert refused.value.code == "file_quota_exceeded"
    assert other.files.create(file=("b.jsonl", content), purpose="batch").bytes == len(content)
    acme.files.delete(kept[0].id)
    assert acme.files.create(file=("b.jsonl", content), purpose="batch").bytes == len(content)
    with pytest.raises(openai.UnprocessableEntityError):
        acme.files.create(file=("c.jsonl", content), purpose="fine-tune")


def test_a_file_has_its_own_size_limit(start: Callable[..., Api]) -> None:
    api = start(max_body_bytes=1000, batch_file_max_bytes=5000)
    acme = api.clients["acme"]
    content = jsonl([chat_line(i) for i in range(40)])
    assert 1000 < len(content[:3000]) <= 5000 < len(content)
    assert acme.files.create(file=("a.jsonl", content[:3000]), purpose="batch").bytes == 3000, (
        "over max_body_bytes"
    )
    with pytest.raises(openai.APIStatusError) as refused:
        acme.files.create(file=("b.jsonl", content), purpose="batch")
    assert refused.value.status_code == 413 and refused.value.code == "payload_too_large"


def test_bad_lines_fail_the_batch_with_their_errors(start: Callable[..., Api]) -> None:
    api = start()
    lines = [
        json.dumps(chat_line(1)),
        "not json",
        json.dumps(chat_line(1)),  # the same custom_id again
        json.dumps({**chat_line(3), "url": "/v1/completions"}),
        json.dumps(chat_line(4, model="no-such-model")),
        json.dumps(chat_line(5, messages=[])),
    ]
    batch = api.batch("acme", jsonl(lines))
    failed = api.wait_status("acme", batch.id, "failed")
    assert failed.failed_at and failed.errors is not None
    found = {(e.line, e.code) for e in failed.errors.data}
    assert found == {
        (2, "invalid_json_line"),
        (3, "duplicate_custom_id"),
        (4, "mismatched_url"),
        (5, "model_not_found"),
        (6, "invalid_request"),
    }
    keys = api.keys
    assert redis_lib.Redis.from_url(api.settings.redis_url or "").xlen(keys.intake("batch")) == 0, "no job"


def test_cancel_ends_the_batch_and_its_jobs(start: Callable[..., Api]) -> None:
    api = start()
    redis = redis_lib.Redis.from_url(api.settings.redis_url or "")
    batch = api.batch("acme", jsonl([chat_line(i) for i in range(5)]))
    running = api.wait_status("acme", batch.id, "in_progress")
    assert running.request_counts.total == 5
    wait_until(lambda: redis.xlen(api.keys.intake("batch")) == 5)  # every line queued as a job
    job = redis.hgetall(api.keys.job(line_job_id(batch.id, 0)))
    assert job[b"tenant"] == b"acme" and job[b"priority"] == b"batch" and job[b"status"] == b"queued"
    assert float(job[b"deadline"]) == running.expires_at == running.created_at + 86_400

    assert api.clients["acme"].batches.cancel(batch.id).status in ("cancelling", "cancelled")
    ended = api.wait_status("acme", batch.id, "cancelled")
    assert ended.cancelled_at and ended.output_file_id is None
    assert ended.request_counts.failed == 5
    errors = [json.loads(x) for x in api.clients["acme"].files.content(ended.error_file_id).text.splitlines()]
    assert [e["custom_id"] for e in errors] == [f"req-{i}" for i in range(5)]
    assert {e["error"]["code"] for e in errors} == {"cancelled"}
    for i in range(5):
        assert redis.hget(api.keys.job(line_job_id(batch.id, i)), "status") == b"cancelled"
    with pytest.raises(openai.ConflictError):
        api.clients["acme"].batches.cancel(batch.id)


def test_a_restarted_feeder_writes_every_line_once(start: Callable[..., Api]) -> None:
    """The batch class has room for 5 lines; the feeder stops with 5 fed, and its cursor is set back
    as if it had died after writing jobs 3 and 4 but before recording them; a second API process
    then feeds the rest. Every line is one job: none lost, none written twice."""
    first = start(queue_depth_limit=10)  # lines fill half the class: 5
    redis = redis_lib.Redis.from_url(first.settings.redis_url or "")
    keys = first.keys
    batch = first.batch("acme", jsonl([chat_line(i) for i in range(12)]))
    wait_until(lambda: redis.hget(keys.batch(batch.id), "fed") == b"5")
    assert redis.xlen(keys.intake("batch")) == 5
    first.close()  # the feeder task is cancelled wherever it is
    redis.hset(keys.batch(batch.id), "fed", "3")

    second = start(queue_depth_limit=100)
    wait_until(lambda: redis.hget(keys.batch(batch.id), "fed") == b"12")
    entries = [fields[b"job_id"].decode() for _, fields in redis.xrange(keys.intake("batch"))]
    assert sorted(entries) == sorted(line_job_id(batch.id, i) for i in range(12))
    assert len(entries) == 12, "no line written twice"
    assert second.clients["acme"].batches.retrieve(batch.id).request_counts.total == 12


def test_a_window_that_passes_expires_the_batch(start: Callable[..., Api]) -> None:
    """Two of four lines fed (the class has room for two), then the window passes (its end set back
    in the record): the fed jobs are cancelled, the two never fed answered `batch_expired`."""
    api = start(queue_depth_limit=4)  # lines fill half the class: 2
    redis = redis_lib.Redis.from_url(api.settings.redis_url or "")
    batch = api.batch("acme", jsonl([chat_line(i) for i in range(4)]))
    wait_until(lambda: redis.hget(api.keys.batch(batch.id), "fed") == b"2")
    redis.hset(api.keys.batch(batch.id), "expires_at", str(int(time.time()) - 1))
    ended = api.wait_status("acme", batch.id, "expired")
    assert ended.expired_at and ended.output_file_id is None
    assert (ended.request_counts.total, ended.request_counts.failed) == (4, 4)
    errors = [json.loads(x) for x in api.clients["acme"].files.content(ended.error_file_id).text.splitlines()]
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [
        ("req-0", "cancelled"),
        ("req-1", "cancelled"),
        ("req-2", "batch_expired"),
        ("req-3", "batch_expired"),
    ]
    assert redis.xlen(api.keys.intake("batch")) <= 2, "no line fed after the window"


def test_an_embeddings_batch_where_none_are_served_is_503(start: Callable[..., Api]) -> None:
    api = start()  # embedding_stages=0
    acme = api.clients["acme"]
    line = {"custom_id": "e", "method": "POST", "url": "/v1/embeddings", "body": {"input": "hi"}}
    uploaded = acme.files.create(file=("e.jsonl", jsonl([line])), purpose="batch")
    with pytest.raises(openai.InternalServerError) as refused:
        acme.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
    assert refused.value.status_code == 503 and refused.value.code == "not_served"
