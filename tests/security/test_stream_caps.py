"""One tenant cannot hold every stream of the API: past CONVEYOR_TENANT_MAX_STREAMS open event
streams (SSE, WebSocket, `stream: true` submits) its next one is 429 `too_many_streams` (a WebSocket
closes 4429), a streaming submit is refused before any job is made, another tenant is not affected,
and a stream that ends gives its slot back.

The real API app served by uvicorn in a thread over a real Redis; the jobs followed are written into
Redis as the API writes them and never run (no worker), so their streams stay open."""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis as redis_lib
import uvicorn
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from app.api.app import create_app
from app.api.auth import key_digest, new_api_key
from app.core.jobrecord import JobRequest
from app.core.keys import Keys
from tests.conftest import free_port
from tests.tinyapi import forget_namespace, namespace_keys, tiny_settings

CAP = 2


@pytest.fixture()
def api(redis_url: str, tiny_model) -> Iterator[tuple[str, Keys, dict[str, str]]]:  # type: ignore[no-untyped-def]
    keys = {"acme": new_api_key(), "other": new_api_key()}
    settings = tiny_settings(
        redis_url, tiny_model, api_keys={key_digest(k): t for t, k in keys.items()}, tenant_max_streams=CAP
    )
    namespace = settings.namespace
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", Keys(namespace), keys
    finally:
        server.should_exit = True
        thread.join(10)
        forget_namespace(redis_url, namespace)


def queued_job(redis_url: str, keys: Keys, tenant: str) -> str:
    """A queued job of `tenant`, as the API writes one (nothing will run it)."""
    job_id = uuid.uuid4().hex
    record = {"id": job_id, "status": "queued", "model": "tiny", "tenant": tenant, "priority": "normal"}
    record |= {
        "created_at": repr(time.time()),
        "request": JobRequest(max_tokens=4).to_json(),
        "prompt_tokens": "3",
    }
    redis_lib.Redis.from_url(redis_url).hset(keys.job(job_id), mapping=record)
    return job_id


@contextlib.contextmanager
def sse(client: httpx.Client, url: str, headers: dict[str, str]) -> Iterator[httpx.Response]:
    with client.stream("GET", url, headers=headers) as response:
        yield response


def error_of(response: httpx.Response) -> dict[str, Any]:
    response.read()
    return dict(response.json()["error"])


def test_a_tenant_past_its_stream_cap_is_refused_and_others_are_not(api, redis_url):  # type: ignore[no-untyped-def]
    base, keys, api_keys = api
    acme, other = {"X-API-Key": api_keys["acme"]}, {"X-API-Key": api_keys["other"]}
    jobs = [queued_job(redis_url, keys, "acme") for _ in range(CAP + 1)]
    theirs = queued_job(redis_url, keys, "other")
    with httpx.Client(base_url=base, timeout=10) as client, contextlib.ExitStack() as open_streams:
        for job in jobs[:CAP]:
            response = open_streams.enter_context(sse(client, f"/v1/jobs/{job}/events", acme))
            assert response.status_code == 200
        with sse(client, f"/v1/jobs/{jobs[CAP]}/events", acme) as refused:
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
            assert error_of(refused)["code"] == "too_many_streams"

        ws_url = base.replace("http", "ws") + f"/v1/jobs/{jobs[CAP]}/ws"
        with connect(ws_url, additional_headers=acme) as ws, pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=10)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 4429

        before = len(namespace_keys(redis_lib.Redis.from_url(redis_url), f"{keys.namespace}:job"))
        body = {"prompt": "hi", "max_tokens": 2, "stream": True}
        answer = client.post("/v1/completions", json={**body, "model": "tiny"}, headers=acme)
        assert answer.status_code == 429 and answer.json()["error"]["code"] == "too_many_streams"
        answer = client.post("/v1/inference", json=body, headers=acme)
        assert answer.status_code == 429
        after = len(namespace_keys(redis_lib.Redis.from_url(redis_url), f"{keys.namespace}:job"))
        assert after == before  # refused before any job was made

        with sse(client, f"/v1/jobs/{theirs}/events", other) as response:
            assert response.status_code == 200  # another tenant's cap is its own

    with httpx.Client(base_url=base, timeout=10) as client:  # acme's streams have closed
        deadline = time.monotonic() + 60
        while True:
            with sse(client, f"/v1/jobs/{jobs[CAP]}/events", acme) as response:
                if response.status_code == 200 or time.monotonic() > deadline:
                    break
            time.sleep(0.1)
        assert response.status_code == 200  # the slots came back
