"""How a stage worker tells the world about tokens: the job's Redis Stream first, pub/sub second.

The stream is the truth (durable, replayable by entry id, capped, expiring); the pub/sub message
only wakes API processes up to read it. One pipeline per decode step covers every sequence.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from app.core.jobs import JobStatus, JobStore, Transition
from app.core.keys import Keys


@dataclass(frozen=True)
class TokenOut:
    job_id: str
    index: int  # 0-based position in the completion
    token_id: int
    text: str  # text that became final with this token (may be empty)
    completion_text: str  # everything released so far, for pollers
    finish_reason: str | None = None  # set on the last token of a sequence
    emit: bool = True  # False for an end-of-sequence token that only finishes the job


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


class Publisher:
    def __init__(self, redis: Any, keys: Keys, jobs: JobStore, *, ttl_s: int, stream_maxlen: int) -> None:
        self.redis = redis
        self.keys = keys
        self.jobs = jobs
        self.ttl_s = ttl_s
        self.stream_maxlen = stream_maxlen

    def tokens(self, outs: list[TokenOut]) -> None:
        """Append one step's tokens; finish the sequences whose last token this is."""
        now = time.time()
        pipe = self.redis.pipeline(transaction=False)
        for out in outs:
            if not out.emit:
                continue
            data = {"index": out.index, "text": out.text, "token_id": out.token_id}
            # The stream's lifetime is set when it is created and renewed when it ends, not per token.
            self._append(pipe, out.job_id, "token", data, expire=out.index == 0)
            fields: dict[str, Any] = {"text": out.completion_text, "completion_tokens": out.index + 1}
            if out.index == 0:
                fields["first_token_at"] = repr(now)
            pipe.hset(self.keys.job(out.job_id), mapping=fields)
        for out in outs:
            if out.finish_reason:
                fields = {
                    "finish_reason": out.finish_reason,
                    "text": out.completion_text,
                    "completion_tokens": out.index + int(out.emit),
                }
                self._end(pipe, out.job_id, JobStatus.SUCCEEDED, fields, "done", {}, now)
        pipe.execute()

    def finish(self, job_id: str, fields: dict[str, Any]) -> None:
        """End a job that produces no token stream (an embedding) as succeeded, with its result."""
        pipe = self.redis.pipeline(transaction=False)
        self._end(pipe, job_id, JobStatus.SUCCEEDED, fields, "done", {}, time.time())
        pipe.execute()

    def fail(self, job_ids: list[str], *, code: str, message: str) -> None:
        """End jobs as failed, with a reason a client can read, from whatever state they are in."""
        now = time.time()
        error = {"code": code, "message": message}
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            self._end(pipe, job_id, JobStatus.FAILED, {"error": error}, "error", error, now)
        pipe.execute()

    def _end(
        self,
        pipe: Any,
        job_id: str,
        status: JobStatus,
        fields: dict[str, Any],
        event: str,
        data: dict[str, Any],
        now: float,
    ) -> None:
        """The final move, then the final event: a client that reads the event sees the final record."""
        self.jobs.enqueue(pipe, Transition(job_id, status, fields), now)
        self._append(pipe, job_id, event, data, expire=True)

    def _append(self, pipe: Any, job_id: str, event: str, data: dict[str, Any], *, expire: bool) -> None:
        stream = self.keys.events(job_id)
        pipe.xadd(stream, {"event": event, "data": _json(data)}, maxlen=self.stream_maxlen, approximate=False)
        if expire:
            pipe.expire(stream, self.ttl_s)
        pipe.publish(self.keys.announce(job_id), event)
