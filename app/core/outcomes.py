"""How the workers tell the world about tokens and ends: the job's Redis Stream first, pub/sub second.

In `app.core` because every layer that ends a job goes through it: the stage and embeddings
workers, and the batcher expiring a queued job. The writes themselves are `JobStore`'s
(app/core/jobstore.py); this adds what a caller decides (the error a client reads, the stream's
limits) and tells the circuit breaker what ended.

The stream is the truth (durable, replayable by entry id, capped, expiring); the pub/sub message
only wakes API processes up to read it. One script per decode step covers every sequence, and
writes a sequence's token only while its job is still `running` in the batch that produced it:
a job that was cancelled, or recovered and rescheduled elsewhere, gets nothing more from this
batch (no token after a `cancelled` event, no duplicate after a recovery), and the step learns
which rows to drop.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from app.core.jobs import JobStatus
from app.core.jobstore import JobStore, Lifetimes, TokenOut
from app.core.keys import CONTROL_MAXLEN, Keys

__all__ = ["Outcomes", "TokenOut"]


class Outcomes:
    """What a worker's jobs came to, written for their clients, the batcher and the circuit breaker:
    a step's tokens (a sequence's last one ends its job), embeddings results, failures, queued jobs
    that expired, and a batch that is over."""

    def __init__(
        self,
        redis: Any,
        keys: Keys,
        jobs: JobStore,
        *,
        life: Lifetimes,  # Settings.lifetimes
        breaker: Callable[[int, int], None] | None = None,  # (succeeded, failed): the circuit breaker
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.jobs = jobs
        self.life = life
        self.breaker = breaker

    def tokens(self, outs: list[TokenOut]) -> set[str]:
        """Append one step's tokens, finish the sequences whose last token this is; return the ids
        of the jobs that are no longer this batch's (cancelled, failed, recovered elsewhere)."""
        gone = self.jobs.step(outs, self.life)
        finished = sum(1 for out in outs if out.finish_reason and out.job_id not in gone)
        if finished and self.breaker is not None:
            self.breaker(finished, 0)
        return gone

    def finish(self, results: dict[str, dict[str, Any]], *, when: dict[str, str] | None = None) -> int:
        """End jobs that produce no token stream (a batch of embeddings) as succeeded, each with its
        result (job id -> fields), in one round trip; returns how many ended here (not those that had
        ended, or, with `when`: the batch the caller serves, had moved on to another batch)."""
        now = time.time()
        pipe = self.redis.pipeline(transaction=False)
        for job_id, fields in results.items():
            self.jobs.end(
                pipe, job_id, JobStatus.SUCCEEDED, fields=fields, data={}, now=now, life=self.life, when=when
            )
        return sum(int(applied) for applied, _ in pipe.execute())

    def batch_done(self, model: str, batch_id: str) -> None:
        """A batch is over: it leaves the model's in-flight batches, and the batcher, woken on its
        control stream, plans with the room it leaves at once (instead of at its next poll)."""
        pipe = self.redis.pipeline(transaction=False)
        self.jobs.batch_out(model, batch_id, pipe=pipe)
        pipe.xadd(
            self.keys.control(),
            {"type": "batch_done", "model": model, "batch_id": batch_id},
            maxlen=CONTROL_MAXLEN,
            approximate=True,
        )
        pipe.execute()

    def fail(
        self, job_ids: list[str], *, code: str, message: str, when: dict[str, dict[str, str]] | None = None
    ) -> int:
        """End jobs as failed, with a reason a client can read, from whatever state they are in;
        returns how many ended here (the others had ended already). `when[job_id]`: the record
        values the move requires (the batch and status the caller read), so a job that moved on
        meanwhile is left alone."""
        now = time.time()
        error = {"code": code, "message": message}
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            guard = (when or {}).get(job_id, {})
            self.jobs.end(
                pipe,
                job_id,
                JobStatus.FAILED,
                fields={"error": error},
                data=error,
                now=now,
                life=self.life,
                when=guard,
            )
        failed = sum(int(applied) for applied, _ in pipe.execute())
        if failed and self.breaker is not None:
            self.breaker(0, failed)
        return failed

    def expire(self, job_ids: list[str], *, reason: str) -> list[str]:
        """End queued jobs whose deadline passed before they started; returns those that expired."""
        now = time.time()
        error = {"code": "expired", "message": reason}
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            self.jobs.end(
                pipe, job_id, JobStatus.EXPIRED, fields={"error": error}, data=error, now=now, life=self.life
            )
        results = pipe.execute()
        return [job_id for job_id, (applied, _) in zip(job_ids, results, strict=True) if int(applied)]

    def emitted(self, job_id: str) -> list[int]:
        """The token ids already in a job's stream, in order: what a recovered job continues from."""
        entries = self.redis.xrange(self.keys.events(job_id), "-", "+")
        tokens = [json.loads(fields[b"data"]) for _, fields in entries if fields[b"event"] == b"token"]
        return [int(t["token_id"]) for t in sorted(tokens, key=lambda t: t["index"])]
