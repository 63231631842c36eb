"""One tenant cannot fill Redis and so stop everyone:

- its jobs (live, and ended until their records expire) are counted at what each may weigh, and past
  its quota (CONVEYOR_TENANT_RETAINED_BYTES) a submit is 429 `tenant_quota_exceeded` with a
  Retry-After while other tenants are admitted; room comes back as its jobs expire;
- an Idempotency-Key expires with its job, not a day later;
- at the high-water mark of Redis's used_memory (90% of maxmemory) every submit is 503 `store_full`
  before Redis refuses anything, reads go on, and submits resume once there is room.

The real API app in process over a real Redis (the shared one; for the high-water mark an embedded
one of the test's own, so that its memory is the test's), no workers: jobs stay queued.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
from conftest import free_port
from fastapi.testclient import TestClient

from app.api.app import create_app
from app.api.auth import key_digest, new_api_key
from app.api.checks import idempotency_digest
from app.core.config import Settings
from app.core.keys import Keys
from app.core.redis import start_embedded
from tests.tinyapi import forget_namespace, tiny_settings

JOB = {"prompt": "hi", "max_tokens": 2}  # counted at ~7.2 KB (jobrecord.retained_bytes)
QUOTA = 25_000  # three such jobs, not four
ENDED_TTL_S = 2
HIGH_WATER = 0.9  # of maxmemory (app/core/admission.py)


@pytest.fixture()
def api(redis_url: str, tiny_model: Path) -> Iterator[tuple[TestClient, dict[str, dict[str, str]], Settings]]:
    keys = {"acme": new_api_key(), "other": new_api_key()}
    settings = tiny_settings(
        redis_url,
        tiny_model,
        api_keys={key_digest(k): t for t, k in keys.items()},
        heartbeat_ttl_s=5e8,  # no workers: the stage gate would refuse after its grace (2 x this)
        tenant_retained_bytes=QUOTA,
        ended_job_ttl_s=ENDED_TTL_S,
    )
    try:
        with TestClient(create_app(settings)) as client:
            yield client, {t: {"X-API-Key": k} for t, k in keys.items()}, settings
    finally:
        forget_namespace(redis_url, settings.namespace)


def test_a_tenant_past_its_quota_is_refused_while_others_are_admitted(api):  # type: ignore[no-untyped-def]
    client, tenants, _ = api
    acme, other = tenants["acme"], tenants["other"]
    mine = [client.post("/v1/jobs", json=JOB, headers=acme) for _ in range(3)]
    assert [a.status_code for a in mine] == [202] * 3, [a.text for a in mine]

    refused = client.post("/v1/jobs", json=JOB, headers=acme)
    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    assert error["code"] == "tenant_quota_exceeded"
    assert error["details"]["limit"] == QUOTA and 3 * 7_000 < error["details"]["retained_bytes"] <= QUOTA
    assert int(refused.headers["Retry-After"]) >= 1
    assert client.post("/v1/completions", json={"model": "tiny", **JOB}, headers=acme).status_code == 429
    assert client.post("/v1/jobs", json=JOB, headers=other).status_code == 202  # its own quota

    for answer in mine:  # ended, they are kept ENDED_TTL_S, then leave the quota
        assert client.post(f"/v1/jobs/{answer.json()['id']}/cancel", headers=acme).status_code == 200
    deadline = time.monotonic() + 30
    while (again := client.post("/v1/jobs", json=JOB, headers=acme)).status_code == 429:
        assert time.monotonic() < deadline, again.text
        time.sleep(0.2)
    assert again.status_code == 202, again.text


def test_an_idempotency_key_expires_with_its_job(api):  # type: ignore[no-untyped-def]
    client, tenants, settings = api
    acme = {**tenants["acme"], "Idempotency-Key": "order-1"}
    job = client.post("/v1/jobs", json=JOB, headers=acme)
    assert job.status_code == 202, job.text
    held = Keys(settings.namespace).idempotency(idempotency_digest("acme", "order-1"))
    redis = redis_lib.Redis.from_url(settings.redis_url or "")
    assert redis.ttl(held) > ENDED_TTL_S  # a live job's key: job_ttl_s, as its job
    assert client.post(f"/v1/jobs/{job.json()['id']}/cancel", headers=acme).status_code == 200
    assert 0 < redis.ttl(held) <= ENDED_TTL_S  # no longer than the ended job it names


@contextmanager
def own_redis(tmp: Path, maxmemory: str) -> Iterator[str]:
    process, url = start_embedded(tmp, free_port(), password=secrets.token_hex(16))
    try:
        redis_lib.Redis.from_url(url).config_set("maxmemory", maxmemory)
        yield url
    finally:
        process.terminate()
        process.wait(10)


def used_share(client: redis_lib.Redis) -> float:
    info: dict[str, Any] = client.info("memory")
    return int(info["used_memory"]) / int(info["maxmemory"])


# In the serial tier: beside another xdist worker it once admitted 500 jobs past the mark (its own
# Redis's reading never tripped); alone it passes. Not yet explained.
@pytest.mark.slow
def test_submits_stop_at_the_high_water_mark_before_redis_refuses_anything(tmp_path, tiny_model):  # type: ignore[no-untyped-def]
    with own_redis(tmp_path / "redis", "32mb") as url:
        client = redis_lib.Redis.from_url(url)
        config = tiny_settings(url, tiny_model, auth="none", heartbeat_ttl_s=5e8)  # no stage gate
        with TestClient(create_app(config)) as api:
            job = api.post("/v1/jobs", json=JOB)
            assert job.status_code == 202, job.text
            filler = []
            while used_share(client) < HIGH_WATER + 0.02:  # past the mark, under maxmemory
                filler.append(f"filler:{len(filler)}")
                client.set(filler[-1], b"x" * 256 * 1024)
            assert used_share(client) < 1

            deadline = time.monotonic() + 60  # the API reads used_memory at most once a second
            while api.post("/v1/jobs", json=JOB).status_code == 202:
                assert time.monotonic() < deadline, "submits still admitted past the high-water mark"
                time.sleep(0.1)
            for path, body in [("/v1/jobs", JOB), ("/v1/completions", {"model": "tiny", **JOB})]:
                refused = api.post(path, json=body)
                assert refused.status_code == 503, (path, refused.text)
                error = refused.json()["error"]
                assert error["code"] == "store_full" and error["details"]["reason"] == "high_water"
                assert int(refused.headers["Retry-After"]) >= 1
            assert api.get(f"/v1/jobs/{job.json()['id']}").json()["status"] == "queued"  # reads go on
            client.set("heartbeat-like", b"x" * 1024)  # Redis itself still takes writes

            client.delete(*filler)
            assert api.post("/v1/jobs", json=JOB).status_code == 202  # at once, no stale reading


def test_the_default_quota_is_a_share_of_redis_maxmemory():
    admission = Settings().admission
    assert admission.retained_quota("acme", 2**30) == 2**28  # 256 MiB of the embedded Redis's 1 GB
    assert admission.retained_quota("acme", 0) == 0  # a Redis without maxmemory: no quota
    overridden = Settings(rate_limits={"big": {"retained_bytes": 5}}, tenant_retained_bytes=7).admission
    assert overridden.retained_quota("big", 2**30) == 5 and overridden.retained_quota("x", 2**30) == 7
    assert Settings(auth="none").admission.retained_quota("anonymous", 2**30) == 0  # one tenant
