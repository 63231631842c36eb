"""Admission and overload: priorities, timeout_s, depth limits, deadlines, the breaker and stage
gates, Idempotency-Key, cancellation (asked for, and by a client that goes away).

Two layers: the gates against the real Redis with a clock passed in (no stack: exact numbers), and
one stack (`conveyor up`, the tiny model) served one job at a time, so a long job holds the
pipeline and what is submitted after it waits where a test can count it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import redis as redis_lib
import redis.asyncio
from clients import events, submit, tokens, wait
from harness import TLS, Harness, start_harness
from tiny import make_tiny_model

from app.core import admission as adm
from app.core.admission import Admission, StageSeen, Ticket
from app.core.breaker import Policy, record
from app.core.config import Settings
from app.core.errors import (
    CircuitOpen,
    DeadlineUnmeetable,
    Overloaded,
    QueueFull,
    Refused,
    StageUnavailable,
)
from app.core.jobrecord import JobRecord
from app.core.jobs import JobStatus
from app.core.keys import PRIORITIES, Keys

# --- the gates, on the real Redis, clock passed in -----------------------------------------------

T0 = 1_700_000_000.0


@pytest.fixture()
def settings() -> Settings:
    return Settings(
        namespace=f"test-adm-{uuid.uuid4().hex[:8]}",
        stages=2,
        heartbeat_ttl_s=10.0,
        queue_depth_limit=3,  # and 6 over every class
        # One tenant here (the records name none): the class's limits are the point (tests/security).
        tenant_queue_shares={"": 1.0},
    )


# A breaker that opens on 10 outcomes rather than 100: the tests record a few.
QUICK_BREAKER = Policy(min_requests=10)


def gates(redis_url: str, settings: Settings, body: Callable[[Admission], Awaitable[Any]]) -> Any:
    section = dataclasses.replace(settings.admission, breaker=QUICK_BREAKER)

    async def main() -> Any:
        client = redis.asyncio.Redis.from_url(redis_url)
        try:
            return await body(Admission(client, Keys(settings.namespace), section))
        finally:
            await client.aclose()

    return asyncio.run(main())


def beat(redis: redis_lib.Redis, settings: Settings, at: float, stages: tuple[int, ...] = (0, 1)) -> None:
    for stage in stages:
        redis.zadd(Keys(settings.namespace).workers("m", stage), {f"w{stage}": at})


def check(
    redis_url: str,
    settings: Settings,
    *,
    now: float,
    priority: str = "normal",
    timeout_s: float | None = None,
) -> Ticket:
    return gates(  # type: ignore[no-any-return]
        redis_url,
        settings,
        lambda a: a.check(model="m", priority=priority, timeout_s=timeout_s, now=now),
    )


def bare(job_id: str, priority: str) -> JobRecord:
    """The least record the admit script writes."""
    return JobRecord(
        id=job_id, status=JobStatus.QUEUED, model="m", tenant="", priority=priority, created_at=0.0
    )


def queue(redis_url: str, settings: Settings, priority: str, n: int) -> list[str]:
    """Write n jobs through the admit script; the outcome of each ('ok' or the refusal's code)."""

    async def body(a: Admission) -> list[str]:
        out = []
        for _ in range(n):
            job_id = uuid.uuid4().hex
            ticket = Ticket(model="m", priority=priority, probe=False, rate=None)
            try:
                record = bare(job_id, priority)
                await a.write(ticket, record=record, intake={"job_id": job_id}, idempotency=None)
                out.append("ok")
            except Refused as exc:
                out.append(exc.code)
        return out

    return gates(redis_url, settings, body)  # type: ignore[no-any-return]


def test_a_stage_down_longer_than_the_grace_refuses(redis, redis_url, settings):  # type: ignore[no-untyped-def]
    assert settings.admission.stage_down_after_s == 20  # 2 x heartbeat_ttl_s
    check(redis_url, settings, now=T0)  # never seen a worker: marked down now, within the grace
    with pytest.raises(StageUnavailable) as refused:
        check(redis_url, settings, now=T0 + 21)
    assert refused.value.status == 503 and refused.value.retry_after_s == 10
    assert refused.value.details["stage"] == 0
    beat(redis, settings, T0 + 22)
    check(redis_url, settings, now=T0 + 23)  # both stages live again: the marks are cleared
    assert not redis.exists(Keys(settings.namespace).stage_down("m", 0))
    beat(redis, settings, T0 + 30, stages=(0,))  # stage 1 beat last at T0+22: down since T0+32
    check(redis_url, settings, now=T0 + 50)  # 18 s down: a restart in progress, still admitted
    with pytest.raises(StageUnavailable) as refused:
        check(redis_url, settings, now=T0 + 53)
    assert refused.value.details["stage"] == 1 and refused.value.details["down_for_s"] == 21.0


def test_down_since_is_pure() -> None:
    now, ttl = T0, 10.0
    assert adm.down_since(StageSeen(0, now - 9, None), now=now, ttl_s=ttl) is None
    assert adm.down_since(StageSeen(0, now - 15, None), now=now, ttl_s=ttl) == now - 5
    assert adm.down_since(StageSeen(0, None, now - 7), now=now, ttl_s=ttl) == now - 7
    assert adm.down_since(StageSeen(0, None, None), now=now, ttl_s=ttl) == now
    # a worker beat after the mark was set (it came back and died again): the mark is stale
    assert adm.down_since(StageSeen(0, now - 12, now - 100), now=now, ttl_s=ttl) == now - 2


def test_depth_limits_hold_under_the_atomic_write(redis, redis_url, settings):  # type: ignore[no-untyped-def]
    assert queue(redis_url, settings, "normal", 4) == ["ok", "ok", "ok", "queue_full"]
    assert queue(redis_url, settings, "high", 3) == ["ok", "ok", "ok"]
    assert queue(redis_url, settings, "batch", 1) == ["overloaded"]  # 6 waiting overall: 2 x the depth
    beat(redis, settings, time.time())
    with pytest.raises(Overloaded) as refused:
        check(redis_url, settings, now=time.time(), priority="realtime")
    assert refused.value.status == 503 and refused.value.details["waiting"] == 6


def test_queue_full_is_429_per_class(redis, redis_url, settings):  # type: ignore[no-untyped-def]
    queue(redis_url, settings, "batch", 3)
    beat(redis, settings, time.time())
    with pytest.raises(QueueFull) as refused:
        check(redis_url, settings, now=time.time(), priority="batch")
    assert refused.value.status == 429
    assert refused.value.retry_after_s == settings.admission.limits.retry_after_s
    assert refused.value.details == {"priority": "batch", "waiting": 3, "limit": 3, "retry_after_s": 2}
    check(redis_url, settings, now=time.time(), priority="normal")  # another class has room


def test_deadline_unmeetable_uses_the_measured_rate(redis, redis_url, settings):  # type: ignore[no-untyped-def]
    now = time.time()
    beat(redis, settings, now)
    queue(redis_url, settings, "normal", 2)
    check(redis_url, settings, now=now, timeout_s=0.5)  # no completion measured: no prediction
    keys = Keys(settings.namespace)
    pipe = redis.pipeline()
    record(pipe, keys, "m", succeeded=1, failed=0, now=now - 9.5)
    record(pipe, keys, "m", succeeded=0, failed=1, now=now)
    pipe.execute()
    # 2 jobs ended, the first ~10 s ago: R ~ 0.2 jobs/s; 2 jobs ahead of a normal one: W ~ 10 s
    with pytest.raises(DeadlineUnmeetable) as refused:
        check(redis_url, settings, now=now, timeout_s=5)
    wait_s = refused.value.details["predicted_wait_s"]
    assert 8 <= wait_s <= 11 and refused.value.status == 429
    assert refused.value.retry_after_s == pytest.approx(max(1, wait_s - 5), abs=1)
    check(redis_url, settings, now=now, timeout_s=30)
    check(redis_url, settings, now=now, priority="high", timeout_s=1)  # nothing ahead of `high`
    with pytest.raises(DeadlineUnmeetable):
        check(redis_url, settings, now=now, priority="batch", timeout_s=5)  # normal is ahead of batch


def test_one_idempotency_key_writes_one_job_however_many_race(redis, redis_url, settings):  # type: ignore[no-untyped-def]
    async def race(a: Admission) -> list[str | None]:
        async def one() -> str | None:
            job_id = uuid.uuid4().hex
            ticket = Ticket(model="m", priority="normal", probe=False, rate=None)
            written = await a.write(
                ticket,
                record=bare(job_id, "normal"),
                intake={"job_id": job_id},
                idempotency=("digest", f"{job_id} body-hash"),
            )
            return written.held

        return list(await asyncio.gather(*(one() for _ in range(50))))

    held = gates(redis_url, settings, race)
    assert held.count(None) == 1  # one write made its job; every other was told whose it is
    assert len(set(held) - {None}) == 1
    keys = Keys(settings.namespace)
    assert redis.xlen(keys.intake("normal")) == 1
    assert 0 < redis.ttl(keys.idempotency("digest")) <= settings.job_ttl_s


def test_a_failing_pipeline_opens_the_breaker(redis, redis_url, settings):  # type: ignore[no-untyped-def]
    now = time.time()
    beat(redis, settings, now)
    pipe = redis.pipeline()
    record(pipe, Keys(settings.namespace), "m", succeeded=6, failed=4, now=now - 1)
    pipe.execute()
    with pytest.raises(CircuitOpen) as refused:
        check(redis_url, settings, now=now)
    assert refused.value.status == 503 and refused.value.retry_after_s == QUICK_BREAKER.interval_s
    with pytest.raises(CircuitOpen):
        check(redis_url, settings, now=now + 10)
    beat(redis, settings, now + 31)
    assert check(redis_url, settings, now=now + 31).probe  # half-open: this one is the probe
    with pytest.raises(CircuitOpen):
        check(redis_url, settings, now=now + 31)  # only one


# --- the stack ---------------------------------------------------------------------------------

DEPTH = 4
OVERALL = 2 * DEPTH  # jobs waiting over every class past which submits are 503 overloaded
LONG = {"prompt": "x", "max_tokens": 3000, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def one_at_a_time(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Harness]:
    """One job at a time (one live replica's share of one sequence in flight), small queues, a long
    context."""
    tmp = tmp_path_factory.mktemp("admission")
    model = make_tiny_model(tmp / "tiny-long", context=4096)
    stack = start_harness(
        tmp,
        redis_url=redis_url,
        models={"tiny": model},
        default_model="tiny",
        extra_env={
            "CONVEYOR_MAX_BATCH_SIZE": "1",
            "CONVEYOR_MAX_RUNNING_SEQUENCES": "1",
            "CONVEYOR_TORCH_THREADS": "1",
            "CONVEYOR_MAX_TOKENS_LIMIT": "4000",
            "CONVEYOR_QUEUE_DEPTH_LIMIT": str(DEPTH),
            "CONVEYOR_TENANT_QUEUE_SHARES": '{"anonymous": 1}',  # one tenant fills a class here
        },
    )
    yield stack
    stack.stop()


@pytest.fixture()
def client(one_at_a_time: Harness) -> Iterator[httpx.Client]:
    with one_at_a_time.client() as c:
        yield c
    assert_drained(one_at_a_time)


def assert_drained(stack: Harness, timeout_s: float = 60) -> None:
    """Every test leaves the pipeline idle: nothing waiting in the intake."""
    keys, r = Keys(stack.namespace), redis_lib.Redis.from_url(stack.redis_url or "")
    deadline = time.monotonic() + timeout_s
    while sum(r.xlen(keys.intake(p)) for p in PRIORITIES) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sum(r.xlen(keys.intake(p)) for p in PRIORITIES) == 0


def hold_pipeline(client: httpx.Client) -> dict[str, Any]:
    """A long job, running (its first tokens are out): later jobs wait in the intake behind it."""
    job = submit(client, **LONG)
    assert len(events(client, job["urls"]["events"], max_tokens=2)) >= 2
    return job


def cancel_all(client: httpx.Client, *jobs: dict[str, Any]) -> None:
    for job in jobs:
        client.post(f"/v1/jobs/{job['id']}/cancel")


def job_from_key(stack: Harness, key: str) -> str:
    digest = hashlib.sha256(key.encode()).hexdigest()
    r = redis_lib.Redis.from_url(stack.redis_url or "")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        held = r.get(Keys(stack.namespace).idempotency(digest))
        if held:
            return held.decode().split(" ")[0]
        time.sleep(0.05)
    raise AssertionError("no job for that Idempotency-Key")


def simultaneously(stack: Harness, bodies: list[dict[str, Any]], **kwargs: Any) -> list[httpx.Response]:
    """POST every body to /v1/jobs at the same moment: one thread and client per body, released
    together by a barrier, so the API really handles them at once. Each connects once released: a
    connection opened before would be closed by the API's keep-alive timeout (5 s) where reaching
    the barrier takes longer, on a busy machine, and its POST would find it gone."""
    barrier = threading.Barrier(len(bodies))

    def post(body: dict[str, Any]) -> httpx.Response:
        with httpx.Client(base_url=stack.url, timeout=60, verify=TLS) as c:  # one TLS context for all
            barrier.wait()
            return c.post("/v1/jobs", json=body, **kwargs)

    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(post, bodies))


def test_priorities_and_the_low_alias(client):  # type: ignore[no-untyped-def]
    for priority, stored in [("realtime", "realtime"), ("high", "high"), ("normal", "normal"),
                             ("batch", "batch"), ("low", "batch")]:  # fmt: skip
        job = submit(client, prompt="x", max_tokens=1, priority=priority)
        assert wait(client, job["id"])["priority"] == stored
    answer = client.post("/v1/jobs", json={"prompt": "x", "priority": "urgent"})
    assert answer.status_code == 422 and "realtime" in answer.json()["error"]["message"]


@pytest.mark.parametrize("timeout_s", [0, -1, 3601, "soon"])
def test_timeout_s_out_of_range_is_422(client, timeout_s):  # type: ignore[no-untyped-def]
    answer = client.post("/v1/jobs", json={"prompt": "x", "timeout_s": timeout_s})
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"]["code"] == "invalid_request"
    if timeout_s == 3601:
        assert answer.json()["error"]["details"]["limit"] == 3600


def test_timeout_s_sets_the_deadline(client, one_at_a_time):  # type: ignore[no-untyped-def]
    job = submit(client, prompt="x", max_tokens=1, timeout_s=30)
    done = wait(client, job["id"])
    assert done["status"] == "succeeded"
    assert done["deadline"] == pytest.approx(done["timings"]["created_at"] + 30)
    entry = redis_lib.Redis.from_url(one_at_a_time.redis_url).hget(
        Keys(one_at_a_time.namespace).job(job["id"]), "deadline"
    )
    assert float(entry) == pytest.approx(done["deadline"])


def test_fifty_concurrent_submits_with_one_key_make_one_job(client, one_at_a_time):  # type: ignore[no-untyped-def]
    key = f"idem-{uuid.uuid4().hex}"
    body = {"prompt": "the same job", "max_tokens": 2, "priority": "high"}

    answers = simultaneously(one_at_a_time, [body] * 50, headers={"Idempotency-Key": key})
    assert {a.status_code for a in answers} == {202}
    assert len({a.json()["id"] for a in answers}) == 1
    assert sum(a.headers.get("idempotent-replayed") != "true" for a in answers) == 1
    job_id = answers[0].json()["id"]
    assert wait(client, job_id)["status"] == "succeeded"
    again = client.post("/v1/jobs", json=body, headers={"Idempotency-Key": key})
    assert again.status_code == 202 and again.json()["id"] == job_id
    assert again.headers["idempotent-replayed"] == "true" and again.json()["status"] == "succeeded"
    conflict = client.post("/v1/jobs", json={**body, "max_tokens": 3}, headers={"Idempotency-Key": key})
    assert conflict.status_code == 409
    assert conflict.json()["error"]["code"] == "idempotency_conflict"
    assert conflict.json()["error"]["details"]["job_id"] == job_id
    equivalent = {**body, "priority": "high", "min_tokens": 0}  # a default spelled out: the same job
    assert client.post("/v1/jobs", json=equivalent, headers={"Idempotency-Key": key}).json()["id"] == job_id


def test_cancel_a_queued_job(client):  # type: ignore[no-untyped-def]
    busy = hold_pipeline(client)
    queued = submit(client, prompt="waiting", max_tokens=4)
    answer = client.post(f"/v1/jobs/{queued['id']}/cancel")
    assert answer.status_code == 200, answer.text
    assert answer.json()["status"] == "cancelled"
    assert answer.json()["error"]["code"] == "cancelled"
    stream = events(client, queued["urls"]["events"])
    assert [e.event for e in stream] == ["cancelled"]
    assert stream[-1].data["status"] == "cancelled"
    again = client.post(f"/v1/jobs/{queued['id']}/cancel")
    assert again.status_code == 409
    assert again.json()["error"]["code"] == "job_finished"
    assert again.json()["error"]["details"]["status"] == "cancelled"
    assert client.post("/v1/jobs/nope/cancel").json()["error"]["code"] == "job_not_found"
    cancel_all(client, busy)
    assert wait(client, queued["id"])["status"] == "cancelled"  # the batcher skipped it


def test_cancel_a_finished_job_is_409(client):  # type: ignore[no-untyped-def]
    job = submit(client, prompt="x", max_tokens=1)
    assert wait(client, job["id"])["status"] == "succeeded"
    answer = client.post(f"/v1/jobs/{job['id']}/cancel")
    assert answer.status_code == 409
    assert answer.json()["error"]["details"]["status"] == "succeeded"


def test_cancel_a_running_job_stops_its_tokens(client, one_at_a_time):  # type: ignore[no-untyped-def]
    busy = hold_pipeline(client)
    answer = client.post(f"/v1/jobs/{busy['id']}/cancel")
    assert answer.status_code == 200 and answer.json()["status"] == "cancelled"
    stream = events(client, busy["urls"]["events"])
    assert stream[-1].event == "cancelled" and stream[-1].data["status"] == "cancelled"
    time.sleep(1.0)  # steps already under way had their chance to write a token
    raw = redis_lib.Redis.from_url(one_at_a_time.redis_url).xrange(
        Keys(one_at_a_time.namespace).events(busy["id"])
    )
    names = [fields[b"event"].decode() for _, fields in raw]
    assert names[-1] == "cancelled" and names.count("cancelled") == 1, names[-5:]
    job = client.get(f"/v1/jobs/{busy['id']}").json()
    assert job["status"] == "cancelled" and job["usage"]["completion_tokens"] < LONG["max_tokens"]
    assert len(tokens(stream)) == names.count("token")
    after = submit(client, prompt="next", max_tokens=3)  # the pipeline is free again
    assert wait(client, after["id"], timeout_s=30)["status"] == "succeeded"


def test_queue_full_then_overloaded_with_retry_after(client):  # type: ignore[no-untyped-def]
    busy = hold_pipeline(client)
    normal = [submit(client, prompt="q", max_tokens=1) for _ in range(DEPTH)]
    full = client.post("/v1/jobs", json={"prompt": "q", "max_tokens": 1})
    assert full.status_code == 429, full.text
    assert full.json()["error"]["code"] == "queue_full"
    assert int(full.headers["retry-after"]) >= 1
    assert full.json()["error"]["details"]["limit"] == DEPTH
    # Another class fills the rest (`batch` waits behind the running job; urgent classes would
    # start at once on their reserve), then even a realtime job is refused: the stack is behind.
    later = [submit(client, prompt="q", max_tokens=1, priority="batch") for _ in range(OVERALL - DEPTH)]
    over = client.post("/v1/jobs", json={"prompt": "q", "max_tokens": 1, "priority": "realtime"})
    assert over.status_code == 503, over.text
    assert over.json()["error"]["code"] == "overloaded" and int(over.headers["retry-after"]) >= 1
    cancel_all(client, busy)
    assert {wait(client, j["id"])["status"] for j in normal + later} == {"succeeded"}


def test_a_deadline_the_queue_cannot_meet_is_refused_at_submit(client, one_at_a_time):  # type: ignore[no-untyped-def]
    busy = hold_pipeline(client)  # nothing ends while it runs: the measured rate stands still
    ahead = [submit(client, prompt="q", max_tokens=1) for _ in range(3)]
    keys, r = Keys(one_at_a_time.namespace), redis_lib.Redis.from_url(one_at_a_time.redis_url)
    pipe = r.pipeline()  # as the workers count outcomes: a job ended just now, so R is measured
    record(pipe, keys, "tiny", succeeded=1, failed=0, now=time.time())
    pipe.execute()
    refused = client.post("/v1/jobs", json={"prompt": "q", "max_tokens": 1, "timeout_s": 0.001})
    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    assert error["code"] == "deadline_unmeetable" and refused.headers["retry-after"]
    wait_s = error["details"]["predicted_wait_s"]
    assert wait_s > 0
    accepted = client.post("/v1/jobs", json={"prompt": "q", "max_tokens": 1, "timeout_s": wait_s * 4 + 60})
    assert accepted.status_code == 202, accepted.text
    cancel_all(client, busy)
    jobs = [*ahead, accepted.json()]
    assert {wait(client, j["id"])["status"] for j in jobs} == {"succeeded"}


def test_a_burst_of_ten_times_capacity_gets_only_202_429_503(client, one_at_a_time):  # type: ignore[no-untyped-def]
    bodies = [
        {"prompt": f"burst {i}", "max_tokens": 2, "priority": PRIORITIES[i % 4]}
        | ({"timeout_s": 1.0} if i % 3 == 0 else {})
        for i in range(10 * OVERALL)
    ]

    answers = simultaneously(one_at_a_time, bodies)
    assert {a.status_code for a in answers} <= {202, 429, 503}, {a.status_code for a in answers}
    assert any(a.status_code != 202 for a in answers)
    for a in answers:
        if a.status_code != 202:
            assert int(a.headers["retry-after"]) >= 1
            assert a.json()["error"]["code"] in {"queue_full", "overloaded", "deadline_unmeetable"}
    accepted = [a.json()["id"] for a in answers if a.status_code == 202]
    assert accepted
    ended = {wait(client, job_id)["status"] for job_id in accepted}
    assert ended <= {"succeeded", "expired"}, ended


def test_a_client_that_disconnects_from_a_stream_cancels_its_job(client, one_at_a_time):  # type: ignore[no-untyped-def]
    key = f"stream-{uuid.uuid4().hex}"
    body = {**LONG, "stream": True}
    seen = 0
    with client.stream("POST", "/v1/inference", json=body, headers={"Idempotency-Key": key}) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            seen += line == "event: token"
            if seen == 2:
                break  # and hang up
    job_id = job_from_key(one_at_a_time, key)
    assert wait(client, job_id, timeout_s=30)["status"] == "cancelled"


def test_a_client_that_stops_waiting_cancels_its_job(client, one_at_a_time):  # type: ignore[no-untyped-def]
    key = f"wait-{uuid.uuid4().hex}"
    with (
        pytest.raises(httpx.ReadTimeout),
        httpx.Client(base_url=one_at_a_time.url, timeout=httpx.Timeout(10, read=1.5)) as impatient,
    ):
        impatient.post("/v1/inference", json=LONG, headers={"Idempotency-Key": key})
    job_id = job_from_key(one_at_a_time, key)
    assert wait(client, job_id, timeout_s=30)["status"] == "cancelled"


def test_a_follower_that_disconnects_does_not_cancel(client):  # type: ignore[no-untyped-def]
    job = submit(client, prompt="followed", max_tokens=200, ignore_eos=True)
    assert len(tokens(events(client, job["urls"]["events"], max_tokens=2))) == 2  # and hang up
    assert wait(client, job["id"])["status"] == "succeeded"
