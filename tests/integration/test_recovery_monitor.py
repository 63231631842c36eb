"""The monitor against a real Redis: stalled jobs go back to the intake or fail, fresh ones stay."""

import json
import time
import uuid

from app.batching.recovery import Monitor
from app.core.jobstore import JobStore


def monitor(redis, keys, **overrides):  # type: ignore[no-untyped-def]
    options = {"stall_timeout_s": 5.0, "max_attempts": 3, "ttl_s": 60, "stream_maxlen": 100, "stages": 1}
    return Monitor(redis, keys, **{**options, **overrides})


def running_job(redis, keys, *, attempts: int = 0, last_progress: float, batch: str = "b1") -> str:  # type: ignore[no-untyped-def]
    job = uuid.uuid4().hex
    record = {"id": job, "status": "running", "model": "m", "priority": "high", "prompt_tokens": 7}
    record |= {"completion_tokens": 5, "attempts": attempts, "batch_id": batch}
    redis.hset(keys.job(job), mapping=record)
    redis.zadd(keys.progress(), {job: last_progress})
    JobStore(redis, keys, ttl_s=3600).batch_sent(redis, "m", batch, [job])
    return job


def live_worker(redis, keys, now: float, name: str = "w1") -> None:  # type: ignore[no-untyped-def]
    redis.zadd(keys.workers("m", 0), {name: now})


def test_a_stalled_job_is_requeued_with_its_prompt_and_tokens_counted(redis, keys):  # type: ignore[no-untyped-def]
    now = time.time()
    live_worker(redis, keys, now)
    stalled = running_job(redis, keys, last_progress=now - 10)
    fresh = running_job(redis, keys, last_progress=now - 1, batch="b2")
    assert monitor(redis, keys).sweep(now) == {stalled: "recovering"}
    record = redis.hgetall(keys.job(stalled))
    assert record[b"status"] == b"recovering" and record[b"attempts"] == b"1"
    assert redis.hget(keys.job(fresh), "status") == b"running"
    [(_, fields)] = redis.xrange(keys.intake("high"))
    assert fields[b"job_id"] == stalled.encode()
    assert fields[b"prompt_tokens"] == b"12"  # the new prefill holds prompt + streamed tokens
    assert fields[b"attempts"] == b"1"
    assert redis.zscore(keys.progress(), stalled) is None
    assert not redis.hexists(keys.inflight("m"), "b1")  # its batch frees the pipeline slot
    assert redis.hexists(keys.inflight("m"), "b2")


def test_the_last_attempt_fails_the_job_with_a_reason_and_a_final_event(redis, keys):  # type: ignore[no-untyped-def]
    now = time.time()
    live_worker(redis, keys, now)
    job = running_job(redis, keys, attempts=2, last_progress=now - 10)
    assert monitor(redis, keys).sweep(now) == {job: "failed"}
    assert redis.hget(keys.job(job), "status") == b"failed"
    assert json.loads(redis.hget(keys.job(job), "error"))["code"] == "worker_lost"
    [(_, event)] = redis.xrange(keys.events(job))
    assert event[b"event"] == b"error"
    assert redis.xlen(keys.intake("high")) == 0


def test_nothing_is_recovered_while_a_stage_has_no_live_worker_or_one_just_joined(redis, keys):  # type: ignore[no-untyped-def]
    now = time.time()
    job = running_job(redis, keys, last_progress=now - 10)
    m = monitor(redis, keys)
    assert m.sweep(now) == {}  # no worker at all: nowhere to run it again
    live_worker(redis, keys, now)
    assert m.sweep(now + 1) == {}  # a worker just joined: it may still be warming up
    live_worker(redis, keys, now + 6)  # it beats on (every 2 s)
    assert m.sweep(now + 7) == {job: "recovering"}


def test_nothing_is_recovered_onto_a_stage_whose_worker_stopped_beating(redis, keys):  # type: ignore[no-untyped-def]
    """A SIGKILLed worker's last beat keeps it in its stage's set for the heartbeat TTL (10 s); with a
    shorter stall timeout, every sweep in that time would spend an attempt of the job on a stage that
    has no worker. Two missed beats (5 s) take it out of the count; its replacement's join restarts
    the clock."""
    now = time.time()
    live_worker(redis, keys, now - 60, name="w1")  # the pipeline has run a while
    m = monitor(redis, keys, stall_timeout_s=3.0)
    m.sweep(now - 60)
    live_worker(redis, keys, now, name="w1")  # its last beat, then the kill
    job = running_job(redis, keys, last_progress=now)
    assert m.sweep(now + 3.5) == {job: "recovering"}  # the stall is real: the first attempt
    redis.hset(keys.job(job), "status", "running")  # run again: the batcher dispatched it
    redis.zadd(keys.progress(), {job: now + 4})
    assert m.sweep(now + 7.5) == {}  # w1 missed two beats: no second attempt while it is gone
    assert m.sweep(now + 9.5) == {}
    live_worker(redis, keys, now + 12, name="w2")  # the replacement joins
    assert m.sweep(now + 12) == {}  # and warms up for a stall timeout
    live_worker(redis, keys, now + 15, name="w2")
    assert m.sweep(now + 15.5) == {job: "recovering"}
    assert redis.hget(keys.job(job), "attempts") == b"2"


def test_an_ended_or_cancelled_job_is_only_forgotten(redis, keys):  # type: ignore[no-untyped-def]
    now = time.time()
    live_worker(redis, keys, now)
    job = running_job(redis, keys, last_progress=now - 10)
    redis.hset(keys.job(job), "status", "cancelled")
    assert monitor(redis, keys).sweep(now) == {}
    assert redis.zscore(keys.progress(), job) is None
    assert redis.xlen(keys.intake("high")) == 0


def test_batches_whose_jobs_all_stopped_progressing_are_pruned(redis, keys):  # type: ignore[no-untyped-def]
    now = time.time()
    running_job(redis, keys, last_progress=now, batch="alive")
    store = JobStore(redis, keys, ttl_s=3600)
    store.batch_sent(redis, "m", "lost", ["gone-1", "gone-2"])
    assert store.prune_batches() == 1
    assert set(redis.hkeys(keys.inflight("m"))) == {b"alive"}
