"""How the workers tell the world about tokens and ends: the job's Redis Stream first, pub/sub second.

In `app.core` because every layer that ends a job writes through it: the stage and embeddings
workers, and the batcher expiring a queued job.

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
from dataclasses import dataclass
from typing import Any

from app.core.jobs import END_LUA, ENDED_FUNCTION, JobStatus, JobStore, Transition, text_of
from app.core.keys import Keys

# KEYS[1] = the progress sorted set; then, per row, the job hash and its event stream.
# ARGV[1..5] = now, stream maxlen, stream ttl, announce channel prefix, ended ttl; then 8 values per
# row: job id, batch id, emit (0/1), index, token event data, completion text, completion tokens,
# finish reason ('' while it goes on). Returns the ids of the rows whose job is no longer theirs.
# A row whose job ended meanwhile (cancelled while running) loses its prompt here: this batch's
# prefill has read it (ENDED_FUNCTION, app/core/jobs.py).
STEP_LUA = (
    ENDED_FUNCTION
    + """
local now, maxlen, ttl, announce, ended_ttl = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local live = {queued = true, scheduled = true, running = true, recovering = true}
local gone = {}
for r = 0, (#KEYS - 1) / 2 - 1 do
  local job, events = KEYS[2 + 2 * r], KEYS[3 + 2 * r]
  local a = 6 + 8 * r
  local id, batch, emit, index = ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3]
  local rec = redis.call('HMGET', job, 'status', 'batch_id')
  if rec[1] ~= 'running' or rec[2] ~= batch then
    table.insert(gone, id)
    if rec[1] and rec[2] == batch and not live[rec[1]] then  -- it ended in this batch
      redis.call('HDEL', job, 'prompt_ids')
    end
  else
    if emit == '1' then
      redis.call('XADD', events, 'MAXLEN', maxlen, '*', 'event', 'token', 'data', ARGV[a + 4])
      if index == '0' then
        redis.call('EXPIRE', events, ttl)
        redis.call('HSET', job, 'first_token_at', now)
      end
      redis.call('PUBLISH', announce .. id, 'token')
    end
    redis.call('HSET', job, 'text', ARGV[a + 5], 'completion_tokens', ARGV[a + 6])
    if ARGV[a + 7] ~= '' then
      -- running -> succeeded, the move TRANSITIONS allows; then the final event
      redis.call('HSET', job, 'status', 'succeeded', 'finished_at', now, 'finish_reason', ARGV[a + 7])
      redis.call('XADD', events, 'MAXLEN', maxlen, '*', 'event', 'done', 'data', '{}')
      ended(job, events, ended_ttl, '')
      redis.call('ZREM', KEYS[1], id)
      redis.call('PUBLISH', announce .. id, 'done')
    else
      redis.call('ZADD', KEYS[1], now, id)
    end
  end
end
return gone
"""
)


@dataclass(frozen=True)
class TokenOut:
    job_id: str
    batch_id: str  # the batch the job was scheduled in (its record's batch_id while it is ours)
    index: int  # 0-based position in the completion
    token_id: int
    text: str  # text that became final with this token (may be empty)
    completion_text: str  # everything released so far, for pollers
    finish_reason: str | None = None  # set on the last token of a sequence
    emit: bool = True  # False for an end-of-sequence token that only finishes the job


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


class Publisher:
    def __init__(
        self,
        redis: Any,
        keys: Keys,
        jobs: JobStore,
        *,
        ttl_s: int,
        stream_maxlen: int,
        outcomes: Callable[[int, int], None] | None = None,  # (succeeded, failed): the circuit breaker
        ended_ttl_s: int | None = None,  # what an ended job keeps its record and stream; None: ttl_s
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.jobs = jobs
        self.ttl_s = ttl_s
        self.ended_ttl_s = ttl_s if ended_ttl_s is None else ended_ttl_s
        self.stream_maxlen = stream_maxlen
        self.outcomes = outcomes
        self._step = redis.register_script(STEP_LUA)
        self._end_script = redis.register_script(END_LUA)

    def tokens(self, outs: list[TokenOut]) -> set[str]:
        """Append one step's tokens, finish the sequences whose last token this is; return the ids
        of the jobs that are no longer this batch's (cancelled, failed, recovered elsewhere)."""
        keys, args = [self.keys.progress()], [repr(time.time()), self.stream_maxlen, self.ttl_s]
        args += [self.keys.announce(""), self.ended_ttl_s]
        for out in outs:
            keys += [self.keys.job(out.job_id), self.keys.events(out.job_id)]
            data = {"index": out.index, "text": out.text, "token_id": out.token_id}
            count = out.index + int(out.emit) if out.finish_reason else out.index + 1
            args += [out.job_id, out.batch_id, int(out.emit), out.index, _json(data)]
            args += [out.completion_text, count, out.finish_reason or ""]
        gone = self._step(keys=keys, args=args)
        finished = sum(1 for out in outs if out.finish_reason and out.job_id not in gone)
        if finished and self.outcomes is not None:
            self.outcomes(finished, 0)
        return {text_of(g) for g in gone}

    def finish(self, job_id: str, fields: dict[str, Any]) -> None:
        """End a job that produces no token stream (an embedding) as succeeded, with its result."""
        pipe = self.redis.pipeline(transaction=False)
        self._end(pipe, job_id, JobStatus.SUCCEEDED, fields, "done", {}, time.time())
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
            self._end(pipe, job_id, JobStatus.FAILED, {"error": error}, "error", error, now, guard)
        failed = sum(int(applied) for applied, _ in pipe.execute())
        if failed and self.outcomes is not None:
            self.outcomes(0, failed)
        return failed

    def expire(self, job_ids: list[str], *, reason: str) -> list[str]:
        """End queued jobs whose deadline passed before they started; returns those that expired."""
        now = time.time()
        error = {"code": "expired", "message": reason}
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            self._end(pipe, job_id, JobStatus.EXPIRED, {"error": error}, "expired", error, now)
        results = pipe.execute()
        return [job_id for job_id, (applied, _) in zip(job_ids, results, strict=True) if int(applied)]

    def _end(
        self,
        pipe: Any,
        job_id: str,
        status: JobStatus,
        fields: dict[str, Any],
        event: str,
        data: dict[str, Any],
        now: float,
        when: dict[str, str] | None = None,
    ) -> None:
        """The final move, then the final event, atomically and only if the move applies: a client
        that reads the event sees the final record, and a job that had already ended (or was
        recovered into another batch meanwhile) gets no second final event. The callers (the stage
        workers, the batcher expiring a queued job) have read the job's inputs or never will."""
        transition = Transition(job_id, status, fields, when or {})
        args = [event, _json(data), self.stream_maxlen, self.ended_ttl_s, self.keys.announce(job_id)]
        args += [job_id, "1"]
        keys = [self.keys.job(job_id), self.keys.events(job_id), self.keys.progress()]
        self._end_script(keys=keys, args=args + transition.script_args(now), client=pipe)

    def emitted(self, job_id: str) -> list[int]:
        """The token ids already in a job's stream, in order: what a recovered job continues from."""
        entries = self.redis.xrange(self.keys.events(job_id), "-", "+")
        tokens = [json.loads(fields[b"data"]) for _, fields in entries if fields[b"event"] == b"token"]
        return [int(t["token_id"]) for t in sorted(tokens, key=lambda t: t["index"])]
