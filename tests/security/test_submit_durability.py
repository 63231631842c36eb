"""Synchronous durability is opt-in and never silently absent: CONVEYOR_SUBMIT_DURABILITY=fsync
stops the API at start on a Redis that can neither WAITAOF (7.2+) nor fsync every write, and runs on
one started with `appendfsync always` (what `conveyor up` starts in that mode), where a submit is
answered 202 once the job is in the AOF.

Each test on an embedded Redis of its own (the AOF settings are the server's)."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
import redis as redis_lib
from fastapi.testclient import TestClient

from app.api.app import create_app
from app.core.config import Settings
from app.core.durability import DurabilityUnavailable
from app.core.keys import Keys
from app.core.redis import start_embedded
from tests.conftest import free_port
from tests.tinyapi import namespace_keys, tiny_settings


def settings(url: str, tiny_model: Path, namespace: str) -> Settings:
    return tiny_settings(url, tiny_model, namespace=namespace, auth="none", submit_durability="fsync")


def test_fsync_on_a_redis_that_cannot_give_it_stops_the_api(tmp_path, tiny_model):  # type: ignore[no-untyped-def]
    process, url = start_embedded(tmp_path / "redis", free_port(), password=uuid.uuid4().hex)  # everysec
    try:
        with (
            pytest.raises(DurabilityUnavailable) as refused,
            TestClient(create_app(settings(url, tiny_model, "d1"))),
        ):
            pass
        message = str(refused.value)
        assert "CONVEYOR_SUBMIT_DURABILITY=fsync" in message and "appendfsync everysec" in message
    finally:
        process.terminate()
        process.wait(10)


def test_fsync_on_a_redis_that_fsyncs_every_write_answers_once_on_disk(tmp_path, tiny_model):  # type: ignore[no-untyped-def]
    process, url = start_embedded(
        tmp_path / "redis", free_port(), password=uuid.uuid4().hex, appendfsync="always"
    )
    namespace = f"test-{uuid.uuid4().hex[:8]}"
    keys = Keys(namespace)
    try:
        redis = redis_lib.Redis.from_url(url)
        redis.zadd(keys.workers("tiny", 0), {"w0": time.time() + 60})  # a live stage worker
        with TestClient(create_app(settings(url, tiny_model, namespace))) as client:
            assert client.get("/readyz").json()["checks"]["durability"] == {"fsync": True}
            answer = client.post("/v1/jobs", json={"prompt": "keep me", "max_tokens": 2})
            assert answer.status_code == 202, answer.text
            job_id = answer.json()["id"]
        aof = b"".join(path.read_bytes() for path in (tmp_path / "redis").rglob("*.aof*") if path.is_file())
        assert job_id.encode() in aof  # in the file the server fsyncs before it answers
    finally:
        process.terminate()
        process.wait(10)


def test_a_redis_that_stops_fsyncing_while_the_api_runs_refuses_submits_until_it_does_again(  # type: ignore[no-untyped-def]
    tmp_path, tiny_model
):
    process, url = start_embedded(
        tmp_path / "redis", free_port(), password=uuid.uuid4().hex, appendfsync="always"
    )
    namespace = f"test-{uuid.uuid4().hex[:8]}"
    keys = Keys(namespace)
    try:
        redis = redis_lib.Redis.from_url(url)
        redis.zadd(keys.workers("tiny", 0), {"w0": time.time() + 120})  # a live stage worker
        with TestClient(create_app(settings(url, tiny_model, namespace))) as client:
            assert client.post("/v1/jobs", json={"prompt": "before", "max_tokens": 2}).status_code == 202
            redis.config_set("appendonly", "no")  # an operator (or a replaced server) drops the AOF
            durability = wait_for_durability(client, False)
            assert "appendonly no" in durability["problem"]
            refused = client.post("/v1/jobs", json={"prompt": "not on disk", "max_tokens": 2})
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "store_not_durable"
            assert int(refused.headers["retry-after"]) >= 1
            assert client.get("/readyz").json()["status"] == "not_ready"
            queued = [k for k in namespace_keys(redis, f"{namespace}:job") if k.count(b":") == 2]
            redis.config_set("appendonly", "yes")
            wait_for_durability(client, True)
            assert client.post("/v1/jobs", json={"prompt": "after", "max_tokens": 2}).status_code == 202
        assert len(queued) == 1  # the job before; the refused submit wrote none
    finally:
        process.terminate()
        process.wait(10)


def wait_for_durability(client: TestClient, fsync: bool, timeout_s: float = 15.0) -> dict[str, str]:
    """/readyz's durability check once it says `fsync` (Redis is asked again every few seconds)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        durability = client.get("/readyz").json()["checks"].get("durability", {})
        if durability.get("fsync") is fsync:
            return durability  # type: ignore[no-any-return]
        time.sleep(0.1)
    raise AssertionError(f"/readyz never said fsync={fsync}: {durability}")
