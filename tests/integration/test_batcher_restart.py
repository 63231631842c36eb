"""A batcher killed between a batch's dispatch and its send, against a real Redis.

The dispatch is one transaction (the jobs scheduled, the batch recorded, their progress scored); the
send and the intake entries' acknowledgement come after it. Killed in between, the batcher leaves
jobs scheduled that no worker will see, and entries its successor reads again. The successor must
neither run a job twice nor strand it: the monitor finds it stalled and it runs once more.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from app.batching import intake
from app.batching.scheduler import Batcher
from app.core.config import Settings
from app.core.protocol import StepMessage

MODEL = "m"


class Killed(BaseException):
    """The process dies at the broker: nothing after it runs (no rollback, no acknowledgement)."""


def killed(message: object, queue: str) -> None:
    raise Killed


def test_a_job_scheduled_by_a_batcher_killed_before_its_send_runs_after_the_restart(redis, redis_url, keys):  # type: ignore[no-untyped-def]
    settings = Settings(redis_url=redis_url, namespace=keys.namespace, max_wait_ms=0, stall_timeout_s=1.0)
    redis.zadd(keys.workers(MODEL, 0), {"worker": time.time() + 3600})  # a live stage worker throughout
    job_id = uuid.uuid4().hex
    redis.hset(
        keys.job(job_id), mapping={"id": job_id, "status": "queued", "model": MODEL, "priority": "normal"}
    )
    fields = intake.intake_fields(job_id=job_id, model=MODEL, prompt_tokens=3, priority="normal")
    redis.xadd(keys.intake("normal"), fields)  # type: ignore[arg-type]

    first = Batcher(settings.batcher, redis=redis, send=killed, max_block_ms=10)
    intake.ensure_groups(redis, keys)
    with pytest.raises(Killed):
        for _ in range(100):  # the window closes and the batch goes out on the first rounds
            first.tick()
    assert redis.hget(keys.job(job_id), "status") == b"scheduled"  # and no worker was sent it

    sent: list[StepMessage] = []
    second = Batcher(
        settings.batcher, redis=redis, send=lambda message, _queue: sent.append(message), max_block_ms=10
    )
    stop = threading.Event()
    loop = threading.Thread(target=second.run, args=(stop,), daemon=True)
    loop.start()
    try:
        deadline = time.monotonic() + 60
        while not any(job_id in message.seq_ids for message in sent):
            assert time.monotonic() < deadline, (
                f"the job was never sent: {redis.hgetall(keys.job(job_id))}, "
                f"progress score {redis.zscore(keys.progress(), job_id)}"
            )
            time.sleep(0.05)
    finally:
        stop.set()
        loop.join(10)
    assert [m for m in sent if job_id in m.seq_ids][0].seq_ids == [job_id]
    assert redis.hget(keys.job(job_id), "attempts") == b"1"  # the monitor ran it again, once
