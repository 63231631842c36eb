"""Redis goes away under a running stack, and comes back: the API answers 503 `unavailable` (never
500), /readyz says not ready, and once Redis is back on the same port and data, jobs run again."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from clients import submit, wait
from conftest import free_port, start_stack

from app.core.redis import start_embedded

# Redis going away under a whole stack
pytestmark = pytest.mark.e2e

JOB = {"prompt": "outage", "max_tokens": 4, "temperature": 0}


def test_a_redis_outage_is_503_and_the_stack_resumes(tmp_path: Path, tiny_model: Path) -> None:
    port, data, password = free_port(), tmp_path / "redis", "outage-test-password"
    server, url = start_embedded(data, port, password=password)
    try:
        stack = start_stack(
            tmp_path,
            redis_url=url,
            models={"tiny": tiny_model},
            default_model="tiny",
            extra_env={"CONVEYOR_TORCH_THREADS": "1"},
        )
        try:
            with stack.client() as client:
                before = submit(client, **JOB)
                assert wait(client, before["id"])["status"] == "succeeded"

                server.kill()
                server.wait(10)
                answer = client.post("/v1/jobs", json=JOB)
                assert answer.status_code == 503, answer.text
                assert answer.json()["error"]["code"] == "unavailable"
                assert int(answer.headers["retry-after"]) >= 1
                polled = client.get(f"/v1/jobs/{before['id']}")
                assert polled.status_code == 503 and polled.json()["error"]["code"] == "unavailable"
                ready = client.get("/readyz")
                assert ready.status_code == 503
                assert (
                    ready.json()["status"] == "not_ready" and ready.json()["checks"]["redis"]["ok"] is False
                )

                server, _ = start_embedded(data, port, password=password)  # the same port, data, password
                after = resubmit_until_accepted(client, timeout_s=30)
                assert wait(client, after["id"], timeout_s=60)["status"] == "succeeded"
                assert client.get(f"/v1/jobs/{before['id']}").json()["status"] == "succeeded"  # kept (AOF)
                assert ready_again(client, timeout_s=30)["checks"]["events"] == {"subscribed": True}
            assert stack.process.poll() is None, "the stack stayed up through the outage"
        finally:
            stack.stop()
    finally:
        server.terminate()
        server.wait(10)


def resubmit_until_accepted(client: httpx.Client, *, timeout_s: float) -> dict[str, object]:
    deadline = time.monotonic() + timeout_s
    codes = []
    while time.monotonic() < deadline:
        answer = client.post("/v1/jobs", json=JOB)
        if answer.status_code == 202:
            return answer.json()  # type: ignore[no-any-return]
        codes.append(answer.status_code)
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "unavailable", answer.text
        time.sleep(0.2)
    raise AssertionError(f"no job accepted within {timeout_s} s after Redis came back: {codes[-5:]}")


def ready_again(client: httpx.Client, *, timeout_s: float) -> dict[str, object]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready = client.get("/readyz")
        if ready.status_code == 200 and ready.json()["checks"]["events"]["subscribed"]:
            return ready.json()  # type: ignore[no-any-return]
        time.sleep(0.2)
    raise AssertionError(f"/readyz did not recover: {ready.json()}")
