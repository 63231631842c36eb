"""The job lifecycle (docs/architecture.md): one enum, one transition table, one place that applies a move.

A transition runs as one Lua script on the job's hash, so the check ("is the job in a state this
move may leave?") and the write (new status plus its timestamp) are atomic across processes.
"""

from __future__ import annotations

import enum
import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from app.core.errors import IllegalTransition


class JobStatus(enum.StrEnum):
    QUEUED = "queued"
    SCHEDULED = "scheduled"
    RUNNING = "running"
    RECOVERING = "recovering"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"

    @property
    def is_finished(self) -> bool:
        return self in TERMINAL


TERMINAL = frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.EXPIRED})

S = JobStatus
TRANSITIONS: Mapping[JobStatus, frozenset[JobStatus]] = {
    S.QUEUED: frozenset({S.SCHEDULED, S.CANCELLED, S.EXPIRED, S.FAILED}),
    S.SCHEDULED: frozenset({S.RUNNING, S.QUEUED, S.RECOVERING, S.CANCELLED, S.EXPIRED, S.FAILED}),
    S.RUNNING: frozenset({S.SUCCEEDED, S.FAILED, S.CANCELLED, S.RECOVERING}),
    S.RECOVERING: frozenset({S.SCHEDULED, S.FAILED, S.CANCELLED}),
    S.SUCCEEDED: frozenset(),
    S.FAILED: frozenset(),
    S.CANCELLED: frozenset(),
    S.EXPIRED: frozenset(),
}

# The record field stamped when a job enters a state (the poll view shows them as timings).
TIMESTAMP_FIELD: Mapping[JobStatus, str] = {
    S.QUEUED: "queued_at",
    S.SCHEDULED: "scheduled_at",
    S.RUNNING: "started_at",
    S.RECOVERING: "recovered_at",
    **{s: "finished_at" for s in TERMINAL},
}


def predecessors(target: JobStatus) -> list[str]:
    return [str(src) for src, targets in TRANSITIONS.items() if target in targets]


# transition(key, o): ARGV[o+1..] = target, n, n allowed predecessors, g, g guard field/value
# pairs (the record must hold these values), then field/value pairs to write.
# Returns {1, previous} when applied, {0, current-or-empty} when refused.
TRANSITION_FUNCTION = """
local function transition(key, o)
  local cur = redis.call('HGET', key, 'status')
  if not cur then return {0, ''} end
  local n = tonumber(ARGV[o + 2])
  local g = tonumber(ARGV[o + 3 + n])
  local first = o + 4 + n + 2 * g
  for i = o + 4 + n, first - 1, 2 do
    if redis.call('HGET', key, ARGV[i]) ~= ARGV[i + 1] then return {0, cur} end
  end
  for i = o + 3, o + 2 + n do
    if cur == ARGV[i] then
      redis.call('HSET', key, 'status', ARGV[o + 1])
      for j = first, #ARGV, 2 do redis.call('HSET', key, ARGV[j], ARGV[j + 1]) end
      return {1, cur}
    end
  end
  return {0, cur}
end
"""
TRANSITION_LUA = TRANSITION_FUNCTION + "return transition(KEYS[1], 0)"

# What a job keeps once it has ended. Its inputs (the prompt's token ids, tens of KB for a long
# prompt; an embeddings request's texts, up to a MB) go: nothing runs it again. Its record and
# event stream then live `ended_job_ttl_s` (an hour by default) instead of the `job_ttl_s` a live
# job keeps, so that Redis holds what clients still read (status, text, timings, the replayable
# events) and not a day of every prompt ever submitted.
#
# ended(job, events, ttl, was): `was` is the status the job left. A job that ended while `running`
# keeps its prompt here: stage 0 reads it right after it moved the job to running, and may be about
# to; the last stage drops it at the batch's next step (STEP_LUA), when the prefill has certainly
# read it. Every caller writes the record's final status first.
ENDED_FUNCTION = """
local function ended(job, events, ttl, was)
  if was ~= 'running' then redis.call('HDEL', job, 'prompt_ids') end
  redis.call('HDEL', job, 'input')
  redis.call('EXPIRE', job, ttl)
  redis.call('EXPIRE', events, ttl)
end
"""

# A job's final move and its final event, together or not at all. KEYS = job hash, event stream,
# progress set. ARGV[1..7] = event, data, stream maxlen, ended ttl (record and stream), announce
# channel, job id, read ('1': the caller is the worker that has read the job's inputs, so they go
# whatever state it left); then the transition's arguments (above). Returns the transition's result.
END_LUA = (
    TRANSITION_FUNCTION
    + ENDED_FUNCTION
    + """
local moved = transition(KEYS[1], 7)
if moved[1] == 1 then
  redis.call('XADD', KEYS[2], 'MAXLEN', ARGV[3], '*', 'event', ARGV[1], 'data', ARGV[2])
  ended(KEYS[1], KEYS[2], ARGV[4], ARGV[7] == '1' and '' or moved[2])
  redis.call('ZREM', KEYS[3], ARGV[6])
  redis.call('PUBLISH', ARGV[5], ARGV[1])
end
return moved
"""
)


@dataclass(frozen=True)
class Transition:
    """One requested move of one job, with the extra fields written when it applies."""

    job_id: str
    target: JobStatus
    fields: Mapping[str, Any] = field(default_factory=dict)
    # The move applies only while the record holds these values (e.g. the batch a worker serves).
    when: Mapping[str, str] = field(default_factory=dict)

    def script_args(self, now: float) -> list[str]:
        allowed = predecessors(self.target)
        writes: dict[str, Any] = {TIMESTAMP_FIELD[self.target]: now, **self.fields}
        args = [str(self.target), str(len(allowed)), *allowed, str(len(self.when))]
        for name, value in self.when.items():
            args += [name, value]
        for name, value in writes.items():
            args += [name, encode_field(value)]
        return args


def check_result(transition: Transition, result: list[Any], *, strict: bool) -> bool:
    applied, current = int(result[0]), text_of(result[1])
    if applied:
        return True
    if strict:
        raise IllegalTransition(transition.job_id, current or None, transition.target)
    return False


def encode_field(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool | int | float):
        return repr(value) if isinstance(value, float) else str(int(value))
    return json.dumps(value, separators=(",", ":"))


def text_of(value: Any) -> str:
    """A Redis reply as text: bytes decoded, None as the empty string."""
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else str(value)


def decode_record(raw: Mapping[Any, Any]) -> dict[str, str]:
    return {text_of(k): text_of(v) for k, v in raw.items()}


class JobStore:
    """Synchronous job-record operations for the batcher and the stage workers."""

    def __init__(self, redis: Any, keys: Any, *, ttl_s: int) -> None:
        self.redis = redis
        self.keys = keys
        self.ttl_s = ttl_s
        self._script = redis.register_script(TRANSITION_LUA)

    def apply(self, transitions: Iterable[Transition], *, strict: bool = True) -> list[str]:
        """Apply moves in one round trip; returns the ids whose move applied.

        With strict=True an illegal move raises (a bug); with strict=False it is skipped, which is
        what at-least-once consumers want for a move that a duplicate delivery already made.
        """
        transitions = list(transitions)
        now = time.time()
        pipe = self.redis.pipeline(transaction=False)
        for t in transitions:
            self.enqueue(pipe, t, now)
        results = pipe.execute()
        return [
            t.job_id for t, r in zip(transitions, results, strict=True) if check_result(t, r, strict=strict)
        ]

    def enqueue(self, pipe: Any, transition: Transition, now: float) -> None:
        """Add a move to a caller's pipeline (its result is not checked: a refused move is a no-op)."""
        self._script(keys=[self.keys.job(transition.job_id)], args=transition.script_args(now), client=pipe)

    def get(self, job_id: str) -> dict[str, str] | None:
        raw = self.redis.hgetall(self.keys.job(job_id))
        return decode_record(raw) if raw else None

    def get_many(self, job_ids: list[str], *fields: str) -> list[dict[str, str]]:
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hmget(self.keys.job(job_id), list(fields))
        return [
            {name: text_of(v) for name, v in zip(fields, values, strict=True) if v is not None}
            for values in pipe.execute()
        ]
