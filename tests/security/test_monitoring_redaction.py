"""Monitoring shows no job's data: Flower (and Celery's events and logs) render a task's arguments
from the `argsrepr` header its sender wrote, and Celery's default is the arguments themselves —
prompt token ids, hidden states, another tenant's webhook URL and body. Every sender in
`app.core.broker` writes a summary instead, while the worker still receives the whole message.

Each test sends through the real sender to a real Redis broker and reads the message as it lies in
the queue's list, the way a worker (and the events Flower reads) sees it."""

from __future__ import annotations

import base64
import json
import uuid
from typing import Any

import msgpack
import redis as redis_lib

from app.core.broker import create_celery_app, send_embedding, send_step
from app.core.config import EMBEDDING_MODEL, Settings
from app.core.keys import Keys
from app.core.protocol import StepMessage
from app.partitions.codecs import encode_tensor
from app.webhooks.dispatcher import send_delivery

SECRET_PROMPT_IDS = [31337, 27182, 14142, 17320]
SECRET_URL = "https://tenant-b.example/hooks/private-path-7f3a"
SECRET_OUTPUT = "the other tenant's confidential answer"


def _queued(redis: redis_lib.Redis, queue: str) -> tuple[dict[str, Any], list[Any]]:
    """The one message waiting on `queue` (any priority list): its headers and its decoded args."""
    for name in [key for key in redis.keys(f"{queue}*") if not key.endswith(b"_kombu.binding.")]:
        raw = redis.lpop(name)
        if raw is not None:
            envelope = json.loads(raw)
            body = base64.b64decode(envelope["body"])
            args, _kwargs, _embed = msgpack.unpackb(body, raw=False)
            return envelope["headers"], args
    raise AssertionError(f"no message on {queue}")


def _app(redis_url: str) -> tuple[Any, str]:
    namespace = f"test-{uuid.uuid4().hex[:8]}"
    return create_celery_app(Settings(namespace=namespace), redis_url), namespace


def _assert_redacted(headers: dict[str, Any], *secrets: str) -> None:
    shown = f"{headers.get('argsrepr')} {headers.get('kwargsrepr')}"
    for secret in secrets:
        assert secret not in shown, f"monitoring would show {secret!r}: {shown}"


def test_a_stage_message_shows_its_place_in_the_pipeline_not_its_tensors(redis_url, redis) -> None:  # type: ignore[no-untyped-def]
    import torch

    app, namespace = _app(redis_url)
    queue = f"{namespace}.stage.m.0"
    ids = torch.tensor([SECRET_PROMPT_IDS])
    message = StepMessage(
        batch_id="b" * 32,
        model="m",
        stage=0,
        num_stages=2,
        kind="prefill",
        step=0,
        seq_ids=["job-of-tenant-a", "job-of-tenant-b"],
        tensors={"input_ids": encode_tensor(ids)},
    )
    send_step(app, message, queue)

    headers, args = _queued(redis, queue)
    _assert_redacted(headers, "31337", "job-of-tenant", "input_ids")
    assert headers["argsrepr"] == "<prefill batch bbbbbbbb step 0 stage 0/2 2 seq>"
    assert StepMessage.from_wire(args[0]).seq_ids == message.seq_ids  # the worker still gets it whole


def test_a_webhook_delivery_shows_neither_the_receiver_nor_the_body(redis_url, redis) -> None:  # type: ignore[no-untyped-def]
    app, namespace = _app(redis_url)
    queue = f"{namespace}.callbacks"
    delivery = {
        "job_id": "0123456789abcdef",
        "webhook_id": "msg_feedface",
        "type": "job.succeeded",
        "url": SECRET_URL,
        "tenant": "tenant-b",
        "body": json.dumps({"output": SECRET_OUTPUT}),
        "attempt": 2,
    }
    send_delivery(app, delivery, queue)

    headers, args = _queued(redis, queue)
    _assert_redacted(headers, "tenant-b.example", "private-path", "confidential", "tenant-b")
    assert headers["argsrepr"] == "<job.succeeded webhook msg_feed job 01234567 attempt 2>"
    assert args[0] == delivery


def test_an_embeddings_message_shows_neither_its_input_nor_its_hidden_states(redis_url, redis) -> None:  # type: ignore[no-untyped-def]
    import torch

    app, namespace = _app(redis_url)
    queue = Keys(namespace).stage_queue(EMBEDDING_MODEL, 1)
    hidden = {"hidden": encode_tensor(torch.full((1, 4), 31337.0))}
    message = {"batch_id": "0123456789ab", "job_ids": ["fedcba9876543210"], "rows": [1], "tensors": hidden}
    send_embedding(app, message, queue)

    headers, args = _queued(redis, queue)
    _assert_redacted(headers, "31337", "hidden", "fedcba98")
    assert headers["argsrepr"] == "<embed tensors batch 01234567 1 jobs>"
    assert args[0]["tensors"].keys() == {"hidden"}


def test_the_summary_names_no_job() -> None:
    message = StepMessage(
        batch_id="0" * 32, model="m", stage=1, num_stages=3, kind="decode", step=7, seq_ids=["job-a"] * 5
    )
    assert message.summary() == "<decode batch 00000000 step 7 stage 1/3 5 seq>"
    assert "job-a" not in message.summary()
