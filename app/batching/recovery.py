"""The monitor: finds scheduled or running jobs that stopped making progress and runs them again.

Every sign of progress (the batcher's dispatch, stage 0 starting a prefill, every token) scores
the job in the `progress` sorted set. A job whose score is older than `stall_timeout_s` lost a
worker (killed, out of memory) or sits behind one that missed its step deadline. The monitor
moves it to `recovering`, counts the attempt and puts it back on its class's intake stream, all
in one script (`JobStore.recover`, app/core/jobstore.py); the batcher schedules it again like any
job, and stage 0 prefills it with its prompt plus the tokens it had already streamed (they are in
its event stream), so the client sees the stream continue, with neither a gap nor a duplicate,
after a `recovered` event that names the index it continues from (`{"index", "attempt"}`); a
seeded job draws the same tokens it would have drawn uninterrupted
(`app.workers.sampling.token_seed`). The old batch, if it ever wakes up, can no longer write to
the job (tokens are written only for the batch in its record).

A job that reaches MAX_ATTEMPTS runs fails (`worker_lost`). One recovered more than once runs in a
batch of its own (`windows.Item.alone`): if it is what kills workers, it dies alone.

Recovering only helps where the job can run again, and a worker that comes back still has to
load its weights. So a model's jobs are left alone while one of its stages has no live worker
(heartbeats), and for `stall_timeout_s` after a worker joins: the clock restarts then, instead of
spending an attempt on a pipeline that is still warming up. A worker counts as live here while it
beats on time: one that has missed two beats (half the heartbeat TTL; it beats five times per TTL)
has most likely died, though its last beat keeps it in the stage's set for the whole TTL, and a
stall timeout shorter than that would otherwise spend every attempt of a job on a dead stage.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from app.batching.intake import intake_fields
from app.core import breaker, metrics
from app.core.jobs import text_of
from app.core.jobstore import JobStore, Lifetimes
from app.core.keys import Keys

log = logging.getLogger(__name__)
# Runs of one job (the first included) before it fails as worker_lost. A job that a worker died or
# stalled under three times is more likely the cause than the victim: more runs would let it take out
# more workers.
MAX_ATTEMPTS = 3


class Monitor:
    def __init__(
        self,
        redis: Any,
        keys: Keys,
        *,
        stall_timeout_s: float,
        max_attempts: int,
        ttl_s: int,
        stream_maxlen: int,
        stages: int | Callable[[str], int] = 1,
        heartbeat_ttl_s: float = 10.0,
    ) -> None:
        """`stages`: every model's stage count, or a model's (`BatcherSettings.stages_of`)."""
        self.stages_of = stages if callable(stages) else lambda _model: stages
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.members: dict[str, list[set[str]]] = {}  # model -> live workers per stage, last sweep
        self.joined_at: dict[str, float] = {}  # model -> when a worker last joined its pipeline
        self.redis = redis
        self.keys = keys
        self.stall_timeout_s = stall_timeout_s
        self.max_attempts = max_attempts
        self.ttl_s = ttl_s
        self.stream_maxlen = stream_maxlen
        self.jobs = JobStore(redis, keys, ttl_s=ttl_s)

    def sweep(self, now: float | None = None) -> dict[str, str]:
        """Recover every stalled job; returns job id -> new status (recovering or failed)."""
        now = time.time() if now is None else now
        cutoff = now - self.stall_timeout_s
        stalled = [text_of(j) for j in self.redis.zrangebyscore(self.keys.progress(), "-inf", cutoff)]
        if not stalled:
            return {}
        pipe = self.redis.pipeline(transaction=False)
        for job_id in stalled:
            pipe.hmget(
                self.keys.job(job_id),
                ["model", "priority", "prompt_tokens", "completion_tokens", "tenant", "kind"],
            )
        records = pipe.execute()
        moved: dict[str, str] = {}
        ready: dict[str, bool] = {}
        for job_id, (model, priority, prompt, completion, tenant, kind) in zip(stalled, records, strict=True):
            if model is None:  # the record expired: nothing to run
                self.jobs.unprogressed([job_id])
                continue
            model, priority = text_of(model), text_of(priority or b"normal")
            if model not in ready:
                ready[model] = self.pipeline_ready(model, now)
            if not ready[model]:
                continue
            tokens = int(prompt or 0) + int(completion or 0)  # what the new prefill will hold
            error = {
                "code": "worker_lost",
                "message": f"no progress for {self.stall_timeout_s:g} s in {self.max_attempts} attempts "
                "(a worker died or missed its step deadline each time)",
            }
            entry = intake_fields(
                job_id=job_id,
                model=model,
                prompt_tokens=tokens,
                priority=priority,
                tenant=text_of(tenant),
                kind=text_of(kind) if kind else None,
            )
            status = self.jobs.recover(
                job_id,
                priority=priority,
                model=model,
                stalled_before=cutoff,
                now=now,
                max_attempts=self.max_attempts,
                life=Lifetimes(self.ttl_s, self.ttl_s, self.stream_maxlen),
                error=error,
                entry=entry,
            )
            if status == "failed":  # a pipeline that keeps losing workers trips its breaker
                breaker.recorder(self.redis, self.keys, model)(0, 1)
                metrics.job_ended(model, "failed", "worker_lost")
            if status:
                moved[job_id] = status
                log.warning("job %s stalled for %.0f s: %s", job_id, self.stall_timeout_s, status)
        return moved

    def pipeline_ready(self, model: str, now: float) -> bool:
        """Every stage has a worker that beats on time, and none joined within the last
        stall_timeout_s (a join is a worker new to the stage's set of the heartbeat TTL)."""
        pipe = self.redis.pipeline(transaction=False)
        for stage in range(self.stages_of(model)):
            pipe.zrangebyscore(
                self.keys.workers(model, stage), now - self.heartbeat_ttl_s, "+inf", withscores=True
            )
        beats = [{text_of(m): at for m, at in members} for members in pipe.execute()]
        live = [set(stage) for stage in beats]
        before = self.members.get(model)
        if before is not None and any(now_ - was for now_, was in zip(live, before, strict=True)):
            self.joined_at[model] = now
        self.members[model] = live
        if before is None:  # first look: assume the pipeline just formed
            self.joined_at.setdefault(model, now - self.stall_timeout_s)
        on_time = now - self.heartbeat_ttl_s / 2  # two beats missed: most likely dead
        beating = all(any(at >= on_time for at in stage.values()) for stage in beats)
        return beating and now - self.joined_at.get(model, -float("inf")) >= self.stall_timeout_s
