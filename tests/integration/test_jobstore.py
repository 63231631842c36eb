"""The lifecycle script against the real Redis: legal moves apply atomically, illegal ones raise."""

import uuid

import pytest

from app.core.errors import IllegalTransition
from app.core.jobrecord import JobRecord
from app.core.jobs import JobStatus, Transition
from app.core.jobstore import JobStore
from app.core.keys import Keys


@pytest.fixture()
def store(redis):  # type: ignore[no-untyped-def]
    return JobStore(redis, Keys(f"test-{uuid.uuid4().hex[:8]}"), ttl_s=60)


def new_job(store: JobStore) -> str:
    job_id = uuid.uuid4().hex
    record = JobRecord(
        id=job_id, status=JobStatus.QUEUED, model="m", tenant="t", priority="normal", created_at=1.0
    )
    store.redis.hset(store.keys.job(job_id), mapping=record.to_hash())
    store.redis.expire(store.keys.job(job_id), 60)
    return job_id


def test_legal_moves_apply_and_stamp_their_time(store):  # type: ignore[no-untyped-def]
    job = new_job(store)
    assert store.apply([Transition(job, JobStatus.SCHEDULED, {"batch_id": "b1"})]) == [job]
    record = store.get(job)
    assert record.status == "scheduled" and record.batch_id == "b1" and record.scheduled_at > 0
    store.apply([Transition(job, JobStatus.RUNNING)])
    store.apply([Transition(job, JobStatus.SUCCEEDED)])
    assert store.get(job).status == "succeeded"


def test_illegal_move_raises_and_changes_nothing(store):  # type: ignore[no-untyped-def]
    job = new_job(store)
    with pytest.raises(IllegalTransition) as info:
        store.apply([Transition(job, JobStatus.SUCCEEDED)])
    assert info.value.details == {"job_id": job, "current": "queued", "target": "succeeded"}
    assert store.get(job).status == "queued"


def test_non_strict_skips_duplicates_and_missing_jobs(store):  # type: ignore[no-untyped-def]
    job = new_job(store)
    assert store.apply([Transition(job, JobStatus.SCHEDULED)], strict=False) == [job]
    assert (
        store.apply(
            [Transition(job, JobStatus.SCHEDULED), Transition("missing", JobStatus.SCHEDULED)], strict=False
        )
        == []
    )


def test_a_guarded_move_applies_only_while_the_record_holds_the_values(store):  # type: ignore[no-untyped-def]
    job = new_job(store)
    store.redis.hset(store.keys.job(job), "batch_id", "b2")
    stale = Transition(job, JobStatus.SCHEDULED, {"batch_id": "b3"}, when={"batch_id": "b1"})
    assert store.apply([stale], strict=False) == []
    assert store.get(job).status == "queued"
    current = Transition(job, JobStatus.SCHEDULED, {"batch_id": "b3"}, when={"batch_id": "b2"})
    assert store.apply([current]) == [job]
    assert store.get(job).batch_id == "b3"
