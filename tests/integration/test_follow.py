"""The job store's writes and `follow` against a real Redis: a submitted job's record, a cancel's
final event carrying the record as it ended, and a follower that resumes after the final event."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import redis.asyncio

from app.core.errors import JobNotFound
from app.core.follow import Event, follow
from app.core.jobrecord import JobRecord, JobRequest
from app.core.jobs import JobStatus, decode_record
from app.core.jobstore import ADMIT_FIELDS, AsyncJobStore, Lifetimes
from app.core.keys import Keys
from app.core.sampling import SamplingParams

LIFE = Lifetimes(ttl_s=60, ended_ttl_s=30, stream_maxlen=100)


@asynccontextmanager
async def never(_job_id: str) -> AsyncIterator[asyncio.Event]:
    yield asyncio.Event()  # no wake-ups: the follower polls


def record(job_id: str) -> JobRecord:
    request = JobRequest(max_tokens=4, sampling=SamplingParams(temperature=0.0))
    return JobRecord(
        id=job_id,
        status=JobStatus.QUEUED,
        model="m",
        tenant="t",
        priority="normal",
        created_at=1764800000.25,
        request=request,
        prompt_ids=(1, 2),
        prompt_tokens=2,
    )


async def collect(store: AsyncJobStore, job_id: str, after: str | None = None) -> list[Event]:
    return [e async for e in follow(store, job_id, after, wake=never, poll_s=0.05)]


def run(redis_url: str, body):  # type: ignore[no-untyped-def]
    async def main():  # type: ignore[no-untyped-def]
        client = redis.asyncio.Redis.from_url(redis_url)
        keys = Keys(f"test-follow-{uuid.uuid4().hex[:8]}")
        try:
            return await body(AsyncJobStore(client, keys))
        finally:
            async for key in client.scan_iter(count=1000, match=f"{keys.namespace}:*"):
                await client.delete(key)
            await client.aclose()

    return asyncio.run(main())


def test_a_cancelled_job_ends_its_stream_with_the_record_as_it_ended(redis_url: str) -> None:
    async def body(store: AsyncJobStore) -> None:
        job = uuid.uuid4().hex
        entry = {"job_id": job, "model": "m", "prompt_tokens": "3", "priority": "normal"}
        admitted = await store.admit(
            record(job), intake=entry, class_depth=10, overall=10, tenant_depth=10, ttl_s=LIFE.ttl_s
        )
        assert admitted[0] == "ok"
        raw = await store.redis.hgetall(store.keys.job(job))
        stored = {k: v for k, v in decode_record(raw).items() if k not in ADMIT_FIELDS}
        assert stored == record(job).to_hash()
        assert JobRecord.from_hash(stored) == record(job)
        assert await store.cancel(job, reason="bye", life=LIFE) == (True, "queued")
        assert await store.cancel(job, reason="again", life=LIFE) == (False, "cancelled")
        events = await collect(store, job)
        assert [(e.event, e.data) for e in events] == [("cancelled", {"code": "cancelled", "message": "bye"})]
        final = events[0].record
        assert final is not None and final.status == "cancelled" and final.finished_at is not None
        assert final.prompt_ids is None  # a job that ended before it ran drops its inputs
        assert 0 < await store.redis.ttl(store.keys.job(job)) <= LIFE.ended_ttl_s
        # A follower that resumes after the final event finds the job over: nothing more.
        assert await collect(store, job, after=events[0].id) == []

    run(redis_url, body)


def test_following_a_job_that_does_not_exist_is_not_found(redis_url: str) -> None:
    async def body(store: AsyncJobStore) -> None:
        with pytest.raises(JobNotFound):
            await collect(store, "missing")
        assert await store.cancel("missing", reason="x", life=LIFE) == (False, "")

    run(redis_url, body)
