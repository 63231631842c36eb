"""One tenant cannot fill a priority class's queue and so refuse every other tenant: past its share of
`queue_depth_limit` (TENANT_QUEUE_SHARE, a half) its next job is 429 `tenant_queue_full` with a
Retry-After, while other tenants are admitted as long as the class has room; its count goes down as
soon as its jobs leave `queued` (cancelled here: no batcher runs, so their intake entries stay).

The real API app in process over a real Redis with no workers (jobs stay queued); then the admit
script raced from several clients, as several API processes would, and each move of the job store
into and out of the waiting states."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
import redis.asyncio
from fastapi.testclient import TestClient

from app.api.app import create_app
from app.api.auth import key_digest, new_api_key
from app.core.admission import Admission, Ticket
from app.core.config import Settings
from app.core.errors import Refused
from app.core.jobrecord import JobRecord
from app.core.jobs import JobStatus, Transition
from app.core.jobstore import JobStore, Lifetimes
from app.core.keys import Keys
from app.core.outcomes import Outcomes
from app.core.sections import TENANT_QUEUE_SHARE
from tests.tinyapi import forget_namespace, tiny_settings

DEPTH = 10  # queue_depth_limit; the default share (0.5) lets one tenant hold 5


@pytest.fixture()
def api(redis_url: str, tiny_model: Path) -> Iterator[tuple[TestClient, dict[str, dict[str, str]]]]:
    keys = {"acme": new_api_key(), "other": new_api_key()}
    settings = tiny_settings(
        redis_url,
        tiny_model,
        api_keys={key_digest(k): t for t, k in keys.items()},
        heartbeat_ttl_s=5e8,  # no workers: the stage gate would refuse after its grace (2 x this)
        queue_depth_limit=DEPTH,
    )
    namespace = settings.namespace
    assert TENANT_QUEUE_SHARE == 0.5 and settings.admission.tenant_queue_limit("acme") == DEPTH // 2
    try:
        with TestClient(create_app(settings)) as client:
            yield client, {t: {"X-API-Key": k} for t, k in keys.items()}
    finally:
        forget_namespace(redis_url, namespace)


def post(client: TestClient, headers: dict[str, str], priority: str = "normal") -> Any:
    body = {"prompt": "hi", "max_tokens": 2, "priority": priority}
    return client.post("/v1/jobs", json=body, headers=headers)


def test_a_tenant_at_its_share_is_refused_and_others_are_admitted(api):  # type: ignore[no-untyped-def]
    client, tenants = api
    acme, other = tenants["acme"], tenants["other"]
    mine = [post(client, acme) for _ in range(DEPTH // 2)]
    assert [a.status_code for a in mine] == [202] * (DEPTH // 2)

    refused = post(client, acme)
    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    assert error["code"] == "tenant_queue_full"
    assert error["details"] == {"priority": "normal", "waiting": 5, "limit": 5, "retry_after_s": 2}
    assert refused.headers["retry-after"] == "2"  # retry_after_s: no completion rate is measured
    completion = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi"}, headers=acme)
    assert completion.status_code == 429 and completion.json()["error"]["code"] == "tenant_queue_full"

    # The class has room (5 of 10): another tenant is admitted, up to its own share.
    assert [post(client, other).status_code for _ in range(4)] == [202] * 4
    assert post(client, acme, priority="high").status_code == 202  # a share is per class

    for answer in mine:
        assert client.post(f"/v1/jobs/{answer.json()['id']}/cancel", headers=acme).status_code == 200
    # Their intake entries stay until a batcher reads them (9 of 10 in the class), but they no longer
    # wait: the tenant is admitted again.
    again = post(client, acme)
    assert again.status_code == 202, again.text


def bare(job_id: str, tenant: str, priority: str = "normal") -> JobRecord:
    """The least record the admit script writes."""
    return JobRecord(
        id=job_id, status=JobStatus.QUEUED, model="m", tenant=tenant, priority=priority, created_at=0.0
    )


async def submit(admission: Admission, tenant: str, job_id: str | None = None) -> str:
    """Write one job of `tenant` through the admit script: 'ok' or the refusal's code."""
    job_id = job_id or uuid.uuid4().hex
    ticket = Ticket(model="m", priority="normal", probe=False, rate=None)
    record = bare(job_id, tenant)
    try:
        await admission.write(ticket, record=record, intake={"job_id": job_id}, idempotency=None)
    except Refused as exc:
        return exc.code
    return "ok"


def test_concurrent_submits_from_many_api_processes_stop_exactly_at_the_share(redis_url):  # type: ignore[no-untyped-def]
    settings = Settings(namespace=f"test-{uuid.uuid4().hex[:8]}", queue_depth_limit=100)
    share = settings.admission.tenant_queue_limit("acme")  # 50

    async def main() -> list[str]:
        clients = [redis.asyncio.Redis.from_url(redis_url) for _ in range(4)]  # four API processes
        try:
            gates = [Admission(c, Keys(settings.namespace), settings.admission) for c in clients]
            return list(await asyncio.gather(*(submit(gates[i % 4], "acme") for i in range(80))))
        finally:
            for c in clients:
                await c.aclose()

    try:
        outcomes = asyncio.run(main())
        assert outcomes.count("ok") == share
        assert outcomes.count("tenant_queue_full") == 80 - share
    finally:
        forget_namespace(redis_url, settings.namespace)


@pytest.fixture()
def store(redis_url: str) -> Iterator[tuple[Settings, JobStore, Any]]:
    settings = Settings(
        namespace=f"test-{uuid.uuid4().hex[:8]}",
        queue_depth_limit=10,
        tenant_queue_shares={"acme": 0.1},  # one waiting job
    )
    client = redis_lib.Redis.from_url(redis_url)
    try:
        yield settings, JobStore(client, Keys(settings.namespace), ttl_s=settings.job_ttl_s), client
    finally:
        forget_namespace(redis_url, settings.namespace)


def admit(redis_url: str, settings: Settings, tenant: str, job_id: str | None = None) -> str:
    async def main() -> str:
        client = redis.asyncio.Redis.from_url(redis_url)
        try:
            return await submit(
                Admission(client, Keys(settings.namespace), settings.admission), tenant, job_id
            )
        finally:
            await client.aclose()

    return asyncio.run(main())


def test_every_move_out_of_and_back_into_the_queue_keeps_the_count(redis_url, store):  # type: ignore[no-untyped-def]
    settings, jobs, client = store
    keys = Keys(settings.namespace)
    limit = settings.admission.tenant_queue_limit
    assert limit("acme") == 1 and limit("other") == 5
    life = Lifetimes(ttl_s=settings.job_ttl_s, ended_ttl_s=60, stream_maxlen=100)
    outcomes = Outcomes(client, keys, jobs, life=Lifetimes(settings.job_ttl_s, 60, 100))

    job = uuid.uuid4().hex
    assert admit(redis_url, settings, "acme", job) == "ok"
    assert admit(redis_url, settings, "acme") == "tenant_queue_full"
    assert admit(redis_url, settings, "other") == "ok"  # another tenant's share is its own

    jobs.apply([Transition(job, JobStatus.SCHEDULED, {"batch_id": "b1"})])  # the batcher dispatched it
    second = uuid.uuid4().hex
    assert admit(redis_url, settings, "acme", second) == "ok"
    jobs.apply([Transition(second, JobStatus.SCHEDULED, {"batch_id": "b1"})])

    jobs.apply([Transition(job, JobStatus.QUEUED)])  # the broker refused the batch: back in the queue
    assert admit(redis_url, settings, "acme") == "tenant_queue_full"
    outcomes.expire([job], reason="not started before its timeout_s")  # expired in the queue
    assert client.hget(keys.job(job), "status") == b"expired"

    # The monitor recovers the stalled `second`: it waits in the intake again, and counts again.
    now = time.time()
    jobs.progressed([second], now - 100)
    recovered = jobs.recover(
        second,
        priority="normal",
        model="m",
        stalled_before=now - 50,
        now=now,
        max_attempts=3,
        life=life,
        error={"code": "worker_lost", "message": "stalled"},
        entry={"job_id": second},
    )
    assert recovered == "recovering"
    assert admit(redis_url, settings, "acme") == "tenant_queue_full"
    jobs.apply([Transition(second, JobStatus.SCHEDULED, {"batch_id": "b2"})])  # scheduled again

    third = uuid.uuid4().hex
    assert admit(redis_url, settings, "acme", third) == "ok"
    assert outcomes.fail([third], code="worker_error", message="failed while queued") == 1
    assert admit(redis_url, settings, "acme") == "ok"
    # What is left counted: that last job and the other tenant's one; `second` is scheduled.
    assert client.zcard(keys.tenant_waiting()) == 2 == client.zcard(keys.tenant_waiting_expiry())


def test_a_job_whose_record_expired_while_it_waited_stops_counting(redis_url, store):  # type: ignore[no-untyped-def]
    settings, _, client = store
    short = settings.model_copy(update={"job_ttl_s": 1})
    job = uuid.uuid4().hex
    assert admit(redis_url, short, "acme", job) == "ok"
    assert admit(redis_url, short, "acme") == "tenant_queue_full"
    keys = Keys(settings.namespace)
    deadline = time.monotonic() + 60
    while client.exists(keys.job(job)) and time.monotonic() < deadline:  # no move: its TTL passes
        time.sleep(0.05)
    assert not client.exists(keys.job(job))
    assert admit(redis_url, short, "acme") == "ok"
    assert client.zcard(keys.tenant_waiting()) == 1 == client.zcard(keys.tenant_waiting_expiry())


def test_a_tenant_name_cannot_reach_into_another_tenants_count(redis_url, store):  # type: ignore[no-untyped-def]
    """`acme` and a tenant whose name starts with it, or with its member's separator, count apart."""
    settings, _, _ = store
    for tenant in ("acme x", "acme 1:acme", "acm", "", "acme"):  # acme's share is one job
        assert admit(redis_url, settings, tenant) == "ok", tenant
    assert admit(redis_url, settings, "acme") == "tenant_queue_full"
    assert admit(redis_url, settings, "acme x") == "ok"  # 5 each for the others
