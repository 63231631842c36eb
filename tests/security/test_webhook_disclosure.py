"""Webhooks and probes tell one tenant nothing of another, nor anyone the network's inside.

- a 410 Gone from a receiver disables that URL for the tenant whose delivery got it, only: another
  tenant's deliveries to the same URL go on, and its submits naming the URL are accepted;
- the SSRF guard's refusal names the host and the kind of address, never the internal address a name
  resolved to;
- /readyz shows anonymous and non-admin callers counts and states, never worker (host) names, device
  reports or the Redis error (its address): those go to `CONVEYOR_ADMIN_TENANTS` only.

Real receivers on loopback (allow-listed), the real delivery code, a real Redis; the API in process.
"""

from __future__ import annotations

import asyncio
import base64
import http.server
import json
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from fastapi.testclient import TestClient

from app.api.app import create_app
from app.api.auth import key_digest, new_api_key
from app.core.config import Settings
from app.core.keys import Keys
from app.webhooks.delivery import Deliverer
from app.webhooks.intake import CallbackIntake
from app.webhooks.signing import SecretBook
from app.webhooks.ssrf import CallbackRefused, Guard, Reason
from tests.tinyapi import forget_namespace, tiny_settings

SECRET = "whsec_" + base64.b64encode(b"disclosure-test-secret-32-bytes!").decode()


class GoneReceiver(http.server.ThreadingHTTPServer):
    """Answers every POST 410 Gone, counting them."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Gone)
        self.posts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/hook"


class _Gone(http.server.BaseHTTPRequestHandler):
    server: GoneReceiver

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self.server.posts += 1
        self.send_response(410)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def settings(redis_url: str) -> Iterator[Settings]:
    config = Settings(
        redis_url=redis_url,
        namespace=f"test-{uuid.uuid4().hex[:8]}",
        webhook_secrets=[SECRET],
        webhook_allow_cidrs=["127.0.0.1/32"],
    )
    yield config
    forget_namespace(redis_url, config.namespace)


def message(url: str, tenant: str) -> dict[str, object]:
    job_id = uuid.uuid4().hex
    return {
        "job_id": job_id,
        "webhook_id": f"msg_{job_id}_completed",
        "type": "completed",
        "url": url,
        "tenant": tenant,
        "body": json.dumps({"type": "job.completed", "data": {"id": job_id}}),
    }


def outcome(redis, settings: Settings, event: dict[str, object]) -> str:  # type: ignore[no-untyped-def]
    raw = redis.lrange(Keys(settings.namespace).webhook_deliveries(str(event["job_id"])), 0, -1)
    return str(json.loads(raw[-1])["outcome"])


def test_a_410_disables_the_url_for_its_tenant_only(redis, settings) -> None:  # type: ignore[no-untyped-def]
    receiver = GoneReceiver()
    threading.Thread(target=receiver.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    keys = Keys(settings.namespace)
    deliverer = Deliverer(
        redis,
        keys,
        settings.webhook,
        guard=Guard(settings.webhook.allow_cidrs),
        secrets=SecretBook([SECRET]),
        job_ttl_s=settings.job_ttl_s,
    )
    try:
        first = message(receiver.url, "tenant-a")
        deliverer.deliver(first)
        assert receiver.posts == 1 and outcome(redis, settings, first) == "disabled"
        again = message(receiver.url, "tenant-a")
        deliverer.deliver(again)  # tenant-a's own next event: not sent
        assert receiver.posts == 1 and outcome(redis, settings, again) == "skipped"
        other = message(receiver.url, "tenant-b")
        deliverer.deliver(other)  # the same URL for another tenant: still sent
        assert receiver.posts == 2 and outcome(redis, settings, other) == "disabled"
        third = message(receiver.url, "tenant-c")
        deliverer.deliver(third)
        assert receiver.posts == 3
    finally:
        receiver.shutdown()
        receiver.server_close()

    async def submits() -> tuple[CallbackRefused | None, CallbackRefused | None]:
        client = aioredis.Redis.from_url(settings.redis_url or "")
        intake = CallbackIntake(settings.webhook, client, keys)
        answers: list[CallbackRefused | None] = []
        for tenant in ("tenant-a", "tenant-d"):
            try:
                await intake.check(receiver.url, None, tenant=tenant)
                answers.append(None)
            except CallbackRefused as exc:
                answers.append(exc)
        await client.aclose()
        return answers[0], answers[1]

    refused_a, refused_d = asyncio.run(submits())
    assert refused_a is not None and refused_a.reason == Reason.DISABLED
    assert refused_d is None  # a tenant whose receiver never said 410


@pytest.mark.parametrize(
    "address",
    ["10.20.30.40", "192.168.7.9", "127.0.0.53", "169.254.169.254", "fd00::1234", "::ffff:10.9.8.7"],
)
def test_the_ssrf_refusal_does_not_name_the_address_a_name_resolved_to(address: str) -> None:
    guard = Guard(resolver=lambda host, port: ["93.184.215.14", address])  # a public one first
    with pytest.raises(CallbackRefused) as refused:
        guard.check("https://hooks.example.com/x")
    told = json.dumps(refused.value.body())
    assert "hooks.example.com" in told and address not in told
    assert address.split(":")[-1] not in told


KEY, ADMIN_KEY = new_api_key(), new_api_key()
WORKER = "stage0-tiny@ip-10-1-2-3.internal"


@pytest.fixture(scope="module")
def api(redis_url: str, tiny_model: Path) -> Iterator[TestClient]:
    settings = tiny_settings(
        redis_url,
        tiny_model,
        api_keys={key_digest(KEY): "acme", key_digest(ADMIN_KEY): "ops"},
        admin_tenants=["ops"],
    )
    keys = Keys(settings.namespace)
    with TestClient(create_app(settings)) as client:
        import redis as redis_lib

        sync = redis_lib.Redis.from_url(redis_url)
        now = time.time()
        device = {"device": "cuda:0", "memory_used_mib": 1.0, "at": now}
        sync.hset(keys.devices(), WORKER, json.dumps(device))
        sync.hset(keys.stage_info(), WORKER, json.dumps({"model": "tiny", "stage": 0, "at": now}))
        sync.expire(keys.devices(), 600)
        sync.expire(keys.stage_info(), 600)
        yield client
    forget_namespace(redis_url, settings.namespace)


@pytest.mark.parametrize("headers", [{}, {"Authorization": f"Bearer {KEY}"}, {"X-API-Key": "cvk_wrong"}])
def test_readyz_shows_no_worker_names_to_anyone_but_an_admin(
    api: TestClient, headers: dict[str, str]
) -> None:
    answer = api.get("/readyz", headers=headers)
    assert WORKER not in answer.text and "ip-10-1-2-3" not in answer.text
    checks = answer.json()["checks"]
    assert "stages" not in checks and "devices" not in checks and "not_healthy" not in checks["health"]
    assert checks["health"]["unhealthy_replicas"] == 0 and "live_per_stage" in checks["workers"]
    admin = api.get("/readyz", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()["checks"]
    assert WORKER in admin["stages"] and WORKER in admin["devices"] and admin["health"]["not_healthy"] == {}


def test_readyz_does_not_name_redis_when_it_is_down(api: TestClient) -> None:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    live = api.app.state.redis  # type: ignore[attr-defined]
    api.app.state.redis = aioredis.Redis.from_url(f"redis://127.0.0.1:{port}/0")  # type: ignore[attr-defined]
    try:
        down = api.get("/readyz")
    finally:
        api.app.state.redis = live  # type: ignore[attr-defined]
    assert down.status_code == 503 and down.json()["checks"]["redis"]["ok"] is False
    assert str(port) not in down.text and "127.0.0.1" not in down.text
