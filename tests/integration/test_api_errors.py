"""Bad input gets a clear 4xx with a machine-readable body, never a 500."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"model": "no-such-model", "prompt": "hi"}, 404, "model_not_found"),
        ({"prompt": "hi", "temperature": -1}, 422, "invalid_request"),
        ({"prompt": "hi", "priority": "urgent"}, 422, "invalid_request"),
        ({}, 422, "invalid_request"),
        ({"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, 422, "invalid_request"),
        ({"prompt": "hi", "max_tokens": 0}, 422, "invalid_request"),
        ({"prompt": "hi", "unknown_field": 1}, 422, "invalid_request"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, 422, "invalid_request"),
        ({"prompt": ""}, 422, "invalid_request"),
        ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 422, "invalid_request"),
        ({"prompt": "hi", "timeout_s": 0}, 422, "invalid_request"),
        ({"prompt": "hi", "timeout_s": 100_000}, 422, "invalid_request"),
    ],
)
def test_invalid_submissions(stack, body, status, code):  # type: ignore[no-untyped-def]
    with stack.client() as client:
        answer = client.post("/v1/jobs", json=body)
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["code"] == code
    assert answer.json()["error"]["message"]


def test_max_tokens_over_the_limit_states_the_limit(stack):  # type: ignore[no-untyped-def]
    with stack.client() as client:
        answer = client.post("/v1/jobs", json={"prompt": "hi", "max_tokens": 100_000})
    assert answer.status_code == 422
    error = answer.json()["error"]
    assert error["code"] == "max_tokens_exceeded"
    assert "1024" in error["message"] and error["details"]["limit"] == 1024


def test_prompt_longer_than_context_states_the_limit(stack):  # type: ignore[no-untyped-def]
    with stack.client() as client:  # the tiny model's context is 512 tokens, one byte per token
        answer = client.post("/v1/jobs", json={"prompt": "x" * 600, "max_tokens": 8})
    assert answer.status_code == 422
    error = answer.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert "512" in error["message"]


def test_malformed_json_is_422_not_500(stack):  # type: ignore[no-untyped-def]
    with stack.client() as client:
        answer = client.post("/v1/jobs", content=b"{not json", headers={"content-type": "application/json"})
    assert answer.status_code == 422
    assert answer.json()["error"]["code"] == "invalid_request"


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/v1/jobs/nope"), ("GET", "/v1/jobs/nope/events"), ("POST", "/v1/jobs/nope/cancel")],
)
def test_unknown_job_is_404(stack, method, path):  # type: ignore[no-untyped-def]
    with stack.client() as client:
        answer = client.request(method, path)
    assert answer.status_code == 404
    assert answer.json()["error"]["code"] == "job_not_found"


def test_a_bad_idempotency_key_is_422(stack):  # type: ignore[no-untyped-def]
    with stack.client() as client:
        answer = client.post("/v1/jobs", json={"prompt": "x"}, headers={"Idempotency-Key": "k" * 256})
    assert answer.status_code == 422
    assert answer.json()["error"]["code"] == "invalid_request"


def test_bad_last_event_id_is_422(stack):  # type: ignore[no-untyped-def]
    with stack.client() as client:
        job = client.post("/v1/jobs", json={"prompt": "x", "max_tokens": 1}).json()
        answer = client.get(job["urls"]["events"], headers={"Last-Event-ID": "garbage"})
    assert answer.status_code == 422


def test_accepted_job_has_location_and_urls(stack):  # type: ignore[no-untyped-def]
    with stack.client() as client:
        answer = client.post("/v1/jobs", json={"prompt": "x", "max_tokens": 1, "priority": "high"})
        assert answer.status_code == 202
        body = answer.json()
        assert answer.headers["location"] == body["urls"]["self"]
        assert body["status"] == "queued"
        assert client.get(body["urls"]["self"]).json()["priority"] == "high"


def test_health_and_readiness(stack):  # type: ignore[no-untyped-def]
    with stack.client() as client:
        assert client.get("/healthz").json() == {"status": "ok", "checks": {}}
        health = client.get("/health")  # as vLLM and TGI answer it
        assert health.status_code == 200 and health.content == b""
        ready = client.get("/readyz")
        assert ready.status_code == 200
        checks = ready.json()["checks"]
        assert checks["workers"]["live_per_stage"] == {"0": 1}
        assert checks["breaker"]["state"] == "closed" and checks["breaker"]["admitting"]
        assert set(checks["queues"]) == {"realtime", "high", "normal", "batch"}
        assert checks["events"] == {"subscribed": True}
        assert "devices" not in checks  # CPU workers have no device state to report
        assert client.get("/openapi.json").status_code == 200


def test_readiness_shows_what_gpu_workers_report_and_drops_stale_reports(stack, redis):  # type: ignore[no-untyped-def]
    import json
    import time

    from app.core.keys import Keys

    key = Keys(stack.namespace).devices()
    fresh = {"device": "cuda:0", "memory_used_mib": 1024.0, "utilization_pct": 87, "temperature_c": 61}
    redis.hset(key, mapping={"gpu-worker": json.dumps({**fresh, "at": time.time()}),
                             "gone-worker": json.dumps({**fresh, "at": time.time() - 3600})})  # fmt: skip
    try:
        with stack.client() as client:
            devices = client.get("/readyz").json()["checks"]["devices"]
        assert set(devices) == {"gpu-worker"}
        assert devices["gpu-worker"]["temperature_c"] == 61
    finally:
        redis.delete(key)


def test_a_cpu_worker_reports_no_device() -> None:
    from app.workers.device import device_stats

    assert device_stats("cpu") is None
