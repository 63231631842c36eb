"""A batch created with a `callback_url` announces its end once, signed with its tenant's secret:
`batch.failed` for a file with a bad line, `batch.cancelled` for a cancelled batch, with the batch
object as polled. The API app in process (its feeder running), the real dispatcher step and
delivery code, a real receiver on loopback (allow-listed) and a real Redis."""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient
from standardwebhooks.webhooks import Webhook

from app.api import batchfeed
from app.api.app import create_app
from app.api.auth import key_digest, new_api_key
from app.core.config import Settings
from app.core.keys import Keys
from app.webhooks.delivery import Deliverer
from app.webhooks.dispatcher import Dispatcher
from app.webhooks.signing import SecretBook
from app.webhooks.ssrf import Guard
from tests.receivers import Receiver, receiving
from tests.tinyapi import forget_namespace, tiny_settings

SECRET = "whsec_" + base64.b64encode(b"batch-webhooks-test-secret-32byt").decode()
KEY = new_api_key()


@pytest.fixture()
def receiver() -> Iterator[Receiver]:
    with receiving() as server:
        yield server


@pytest.fixture()
def api(
    redis_url: str, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Settings, openai.OpenAI]]:
    monkeypatch.setattr(batchfeed, "FEED_INTERVAL_S", 0.05)
    settings = tiny_settings(
        redis_url,
        tiny_model,
        api_keys={key_digest(KEY): "acme"},
        webhook_secrets=[SECRET],
        webhook_allow_cidrs=["127.0.0.1/32"],
    )
    with TestClient(create_app(settings)) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=http, max_retries=0)
        yield settings, client
    forget_namespace(redis_url, settings.namespace)


def wait_until(check: Callable[[], Any], timeout_s: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(0.05)
    raise AssertionError("the condition did not hold in time")


def deliver_due(redis: Any, settings: Settings) -> int:
    """One dispatcher step over the due retries, each handed to the real delivery code."""
    keys = Keys(settings.namespace)
    deliverer = Deliverer(
        redis,
        keys,
        settings.webhook,
        guard=Guard(settings.webhook.allow_cidrs),
        secrets=SecretBook([SECRET]),
        job_ttl_s=settings.job_ttl_s,
    )
    dispatcher = Dispatcher(redis, keys, settings.webhook, deliverer.deliver, job_ttl_s=settings.job_ttl_s)
    return dispatcher.send_due_retries()


def line(i: int, custom_id: str) -> str:
    body = {"model": "tiny", "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 2}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body})


def test_a_batch_announces_its_end_once_signed(
    api: tuple[Settings, openai.OpenAI], receiver: Receiver, redis: Any
) -> None:
    settings, client = api
    failing, cancelled = f"/failed/{uuid.uuid4().hex}", f"/cancelled/{uuid.uuid4().hex}"
    bad = client.files.create(
        file=("bad.jsonl", (line(0, "a") + "\n" + line(1, "a") + "\n").encode()), purpose="batch"
    )
    good = client.files.create(file=("good.jsonl", (line(0, "a") + "\n").encode()), purpose="batch")
    one = client.batches.create(
        input_file_id=bad.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        extra_body={"callback_url": receiver.url(failing)},
    )
    two = client.batches.create(
        input_file_id=good.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        extra_body={"callback_url": receiver.url(cancelled)},
    )
    client.batches.cancel(two.id)
    for batch_id, status in ((one.id, "failed"), (two.id, "cancelled")):
        wait_until(lambda b=batch_id, s=status: client.batches.retrieve(b).status == s)

    def delivered() -> bool:
        deliver_due(redis, settings)
        return bool(receiver.at(failing) and receiver.at(cancelled))

    wait_until(delivered)
    deliver_due(redis, settings)  # nothing is due twice: each end was announced once
    for path, batch_id, kind in ((failing, one.id, "batch.failed"), (cancelled, two.id, "batch.cancelled")):
        got = receiver.at(path)
        assert len(got) == 1, got
        payload = Webhook(SECRET).verify(got[0][1], got[0][0])  # raises unless signed with the secret
        assert payload["type"] == kind
        assert payload["data"]["id"] == batch_id and payload["data"]["object"] == "batch"
        assert payload["data"]["status"] == kind.removeprefix("batch.")
        assert got[0][0]["webhook-id"] == f"msg_{batch_id}_{kind.removeprefix('batch.')}"
    failed_data = Webhook(SECRET).verify(receiver.at(failing)[0][1], receiver.at(failing)[0][0])["data"]
    assert failed_data["errors"]["data"][0]["code"] == "duplicate_custom_id"


def test_an_internal_callback_url_is_refused_before_the_batch_exists(
    api: tuple[Settings, openai.OpenAI],
) -> None:
    _, client = api
    good = client.files.create(file=("good.jsonl", (line(0, "a") + "\n").encode()), purpose="batch")
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        client.batches.create(
            input_file_id=good.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            extra_body={"callback_url": "http://10.0.0.1/hook"},
        )
    assert refused.value.body["code"] == "callback_url_refused"  # type: ignore[index]
    assert client.batches.list().data == []
