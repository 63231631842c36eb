"""`realtime` jumps every queue, so a tenant submits to it only when CONVEYOR_TENANT_PRIORITIES names
it for that tenant (or for `*`): an unlisted tenant keeps every other class, and is 403
`priority_not_allowed` for realtime on /v1/jobs and the OpenAI routes, with nothing queued.

The API runs in process on the real Redis; no worker is needed (jobs stay queued).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
from fastapi.testclient import TestClient

from app.api.app import create_app
from app.api.auth import key_digest, new_api_key
from app.core.config import Settings
from app.core.keys import Keys
from tests.tinyapi import forget_namespace, tiny_settings

KEYS = {tenant: new_api_key() for tenant in ("acme", "ops")}
JOB = {"prompt": "hi", "max_tokens": 1}
BODIES: dict[str, dict[str, object]] = {
    "/v1/jobs": JOB,
    "/v1/completions": {"model": "tiny", **JOB},
    "/v1/chat/completions": {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
    },
}


def post(api: TestClient, tenant: str, path: str, body: dict[str, object]) -> tuple[int, Any]:
    answer = api.post(path, json=body, headers={"Authorization": f"Bearer {KEYS[tenant]}"})
    return answer.status_code, answer.json()


@pytest.fixture(scope="module")
def settings(redis_url: str, tiny_model: Path) -> Iterator[Settings]:
    config = tiny_settings(
        redis_url,
        tiny_model,
        api_keys={key_digest(key): tenant for tenant, key in KEYS.items()},
        tenant_priorities={"ops": ["realtime", "high", "normal", "batch"]},
    )
    yield config
    forget_namespace(redis_url, config.namespace)


@pytest.fixture(scope="module")
def api(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as client:
        yield client


@pytest.mark.parametrize("path", list(BODIES))
def test_an_unlisted_tenant_may_not_submit_realtime(api: TestClient, settings: Settings, path: str) -> None:
    redis = redis_lib.Redis.from_url(settings.redis_url or "")
    queue = Keys(settings.namespace).intake("realtime")
    before = redis.xlen(queue)
    status, refused = post(api, "acme", path, {**BODIES[path], "priority": "realtime"})
    assert status == 403, refused
    assert refused["error"]["code"] == "priority_not_allowed"
    assert refused["error"]["details"]["allowed"] == ["high", "normal", "batch"]
    assert redis.xlen(queue) == before  # nothing queued
    assert post(api, "acme", "/v1/jobs", {**JOB, "priority": "high"})[0] == 202  # the other classes stay


def test_a_tenant_named_for_realtime_submits_to_it(api: TestClient) -> None:
    assert post(api, "ops", "/v1/jobs", {**JOB, "priority": "realtime"})[0] == 202


def test_the_star_entry_can_give_realtime_to_every_unlisted_tenant(redis_url: str, tiny_model: Path) -> None:
    settings = tiny_settings(
        redis_url,
        tiny_model,
        api_keys={key_digest(KEYS["acme"]): "acme"},
        tenant_priorities={"*": ["realtime", "normal"]},
    )
    with TestClient(create_app(settings)) as client:
        answer = client.post(
            "/v1/jobs", json={**JOB, "priority": "realtime"}, headers={"X-API-Key": KEYS["acme"]}
        )
        assert answer.status_code == 202, answer.text
    forget_namespace(redis_url, settings.namespace)
