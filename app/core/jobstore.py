"""The job record's one writer: every write to a job's hash, its event stream, the `progress` set,
the tenants' waiting sets (`tenant_waiting`, kept in step with the status: WAITING_FUNCTION) and
the batch record (`inflight:{model}`, `inflight_models`).

Who calls what:
- the API (`AsyncJobStore`): `admit` (the record with its intake entry, at submit, for every job
  kind), `cancel`, `forget_embedding` (an embeddings job's vectors, once its caller has them);
- the batcher (`JobStore`): `enqueue` / `apply` (scheduled, back to queued), `progressed`, `recover`
  (the monitor), `end` (a queued job expires, through `Outcomes`), and the batch record:
  `batch_sent`, `batch_narrowed`, `batch_out`, `prune_batches`;
- the stage and embeddings workers (`JobStore`): `apply` (running), `progressed`, `step` (one decode
  step's tokens, and the end of the sequences it finishes), `set_prompt_tokens` (an embeddings
  job's, once tokenized), `end` (succeeded with a result, failed), `batch_out` (through
  `Outcomes.batch_done`).

Every move is one Lua script (app/core/jobscripts.py) that checks the job's current status and
writes the new one with its timestamp atomically. The states a script may move a job from are
generated from `TRANSITIONS` (app/core/jobs.py), never written by hand, and a final move appends its
final event (`FINAL_EVENT`) in the same script, so a client that reads the event finds the final record.
`tests/unit/test_job_writes.py` fails if any other module of `app/` writes these keys.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from app.core.jobrecord import JobRecord, retained_bytes
from app.core.jobs import (
    FINAL_EVENT,
    JobStatus,
    Transition,
    check_result,
    text_of,
)
from app.core.jobscripts import ADMIT_LUA, END_LUA, RECOVER_LUA, STEP_LUA, TRANSITION_LUA
from app.core.keys import PRIORITIES, Keys
from app.core.scripts import Script

S = JobStatus


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _items(mapping: Mapping[str, Any]) -> list[Any]:
    return [x for pair in mapping.items() for x in pair]


# Fields the admit script adds to a record beside JobRecord's (in its `other`): the keys that end
# with the job (its tenant's retained set and its member there, its Idempotency-Key).
ADMIT_FIELDS = ("retained_in", "retained_as", "idempotency_key")

# A job's event stream holds its tokens and a few other events (recovered, the final one, ...);
# its cap leaves room for these beside `max_tokens_limit` tokens.
EVENTS_BESIDE_TOKENS = 16


@dataclass(frozen=True)
class Lifetimes:
    """How long a job's record and stream live, and how long its stream may grow
    (`Settings.lifetimes`)."""

    ttl_s: int  # while the job is live
    ended_ttl_s: int  # once it has ended
    stream_maxlen: int


def _end_call(
    keys: Keys,
    job_id: str,
    status: JobStatus,
    *,
    fields: Mapping[str, Any],
    data: str,
    now: float,
    life: Lifetimes,
    read: bool,
    when: Mapping[str, str] | None = None,
) -> tuple[dict[str, str], dict[str, Any]]:
    """END_LUA's keys and arguments for one job's final move to `status`; `data`: its final event's
    data, JSON."""
    transition = Transition(job_id, status, fields, when or {})
    return (
        {
            "job": keys.job(job_id),
            "events": keys.events(job_id),
            "progress": keys.progress(),
            **_waiting_keys(keys),
        },
        {
            "event": FINAL_EVENT[status],
            "data": data,
            "maxlen": life.stream_maxlen,
            "ttl": life.ended_ttl_s,
            "announce": keys.announce(job_id),
            "id": job_id,
            "read": read,
            "move": transition.script_move(now),
        },
    )


def _waiting_keys(keys: Keys) -> dict[str, str]:
    """The tenants' waiting sets, which every script that moves a job keeps in step (WAITING_FUNCTION)."""
    return {"waiting": keys.tenant_waiting(), "expiry": keys.tenant_waiting_expiry()}


# --- the writers -----------------------------------------------------------------------------------


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
    # The token's log probability and the likeliest (token id, log probability) pairs, when its
    # job asked for them (SamplingParams.logprobs).
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    # Echo's prompt logprobs, on a job's first token (SamplingParams.prompt_logprobs): per prompt
    # token after the first, [its log probability, [[id, log probability], ...]]; a `prompt` event.
    prompt_logprobs: list[Any] | None = None


class JobStore:
    """Synchronous job-record operations for the batcher and the stage and embeddings workers."""

    def __init__(self, redis: Any, keys: Keys, *, ttl_s: int) -> None:
        self.redis = redis
        self.keys = keys
        self.ttl_s = ttl_s
        self._transition = Script(redis, TRANSITION_LUA)
        self._end = Script(redis, END_LUA)
        self._step = Script(redis, STEP_LUA)
        self._recover = Script(redis, RECOVER_LUA)

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
        keys, args = (
            {"job": self.keys.job(transition.job_id), **_waiting_keys(self.keys)},
            {"move": transition.script_move(now)},
        )
        self._transition(keys=keys, args=args, client=pipe)

    def progressed(self, job_ids: Sequence[str], now: float, *, pipe: Any = None) -> None:
        """Score jobs in `progress` (dispatched, prefill started): the monitor's stall clock restarts.
        With `pipe`, added to the caller's pipeline (the batcher's dispatch transaction)."""
        (pipe or self.redis).zadd(self.keys.progress(), dict.fromkeys(job_ids, now))

    def progress_of(self, pipe: Any, job_ids: Sequence[str]) -> None:
        """Queue each job's progress score on the caller's transaction (None: not in `progress`),
        read before the rest of it: the jobs an earlier dispatch already holds."""
        for job_id in job_ids:
            pipe.zscore(self.keys.progress(), job_id)

    def unprogressed(self, job_ids: Sequence[str]) -> None:
        """Take jobs out of `progress` (their dispatch was undone, or their record has expired)."""
        if job_ids:
            self.redis.zrem(self.keys.progress(), *job_ids)

    def set_prompt_tokens(self, counts: Mapping[str, int]) -> None:
        """Embeddings jobs' input lengths in tokens (job id -> count), once their first stage has
        tokenized them."""
        pipe = self.redis.pipeline(transaction=False)
        for job_id, count in counts.items():
            pipe.hset(self.keys.job(job_id), "prompt_tokens", count)
        pipe.execute()

    def step(self, outs: Sequence[TokenOut], life: Lifetimes) -> set[str]:
        """Append one step's tokens, finish the sequences whose last token this is; return the ids
        of the jobs that are no longer this batch's (cancelled, failed, recovered elsewhere)."""
        jobs, events, rows = [], [], []
        for out in outs:
            row = {"id": out.job_id, "batch": out.batch_id, "text": "", "tokens": 0, "finish": ""}
            if out.prompt_logprobs is not None:
                jobs.append(self.keys.job(out.job_id))
                events.append(self.keys.events(out.job_id))
                data = _json({"prompt_logprobs": out.prompt_logprobs})
                rows.append(row | {"emit": 2, "index": -1, "data": data})
            jobs.append(self.keys.job(out.job_id))
            events.append(self.keys.events(out.job_id))
            token: dict[str, Any] = {"index": out.index, "text": out.text, "token_id": out.token_id}
            if out.logprob is not None:
                token |= {"logprob": out.logprob, "top_logprobs": [list(pair) for pair in out.top_logprobs]}
            count = out.index + int(out.emit) if out.finish_reason else out.index + 1
            row |= {"emit": int(out.emit), "index": out.index, "data": _json(token)}
            row |= {"text": out.completion_text, "tokens": count, "finish": out.finish_reason or ""}
            rows.append(row)
        keys, args = (
            {"progress": self.keys.progress(), "jobs": jobs, "events": events},
            {
                "now": repr(time.time()),
                "maxlen": life.stream_maxlen,
                "ttl": life.ttl_s,
                "announce": self.keys.announce(""),
                "ended_ttl": life.ended_ttl_s,
                "rows": rows,
            },
        )
        return {text_of(g) for g in self._step(keys=keys, args=args)}

    def end(
        self,
        pipe: Any,
        job_id: str,
        status: JobStatus,
        *,
        fields: Mapping[str, Any],
        data: Mapping[str, Any],
        now: float,
        life: Lifetimes,
        when: Mapping[str, str] | None = None,
    ) -> None:
        """Add a final move and its final event to a caller's pipeline; applied atomically and only
        if the move applies, so a job that had already ended (or was recovered into another batch
        meanwhile) gets no second final event. The callers (the stage workers, the batcher expiring a
        queued job) have read the job's inputs or never will: they go whatever state it left."""
        keys, args = _end_call(
            self.keys,
            job_id,
            status,
            fields=fields,
            data=_json(data),
            now=now,
            life=life,
            read=True,
            when=when,
        )
        self._end(keys=keys, args=args, client=pipe)

    def recover(
        self,
        job_id: str,
        *,
        priority: str,
        model: str,
        stalled_before: float,
        now: float,
        max_attempts: int,
        life: Lifetimes,
        error: Mapping[str, str],
        entry: Mapping[str, str],
    ) -> str:
        """Move a stalled job to recovering and back onto its class's intake stream (`entry`), or to
        failed once it has had `max_attempts`; returns its new status, '' when it was left alone."""
        keys, args = (
            {
                "progress": self.keys.progress(),
                "job": self.keys.job(job_id),
                "events": self.keys.events(job_id),
                "intake": self.keys.intake(priority),
                "inflight": self.keys.inflight(model),
                **_waiting_keys(self.keys),
            },
            {
                "id": job_id,
                "stalled_before": repr(stalled_before),
                "max_attempts": max_attempts,
                "now": repr(now),
                "maxlen": life.stream_maxlen,
                "ttl": life.ended_ttl_s,
                "announce": self.keys.announce(job_id),
                "error": json.dumps(error),
                "entry": _items(entry),
            },
        )
        return text_of(self._recover(keys=keys, args=args))

    # The batch record: a model's batches out at its stages (`inflight:{model}`, batch id -> its job
    # ids; `inflight_models` names the models that have one). The batcher counts them against a
    # pipeline's room; each leaves when its last stage is done (`batch_out`), when none of its jobs
    # progresses any more (`prune_batches`), or with a recovered job (RECOVER_LUA).

    def batch_sent(self, pipe: Any, model: str, batch_id: str, job_ids: Sequence[str]) -> None:
        """`batch_id` is out with `job_ids`, in the caller's transaction (the one that schedules them)."""
        pipe.hset(self.keys.inflight(model), batch_id, json.dumps(list(job_ids)))
        pipe.sadd(self.keys.inflight_models(), model)

    def batch_narrowed(self, model: str, batch_id: str, job_ids: Sequence[str]) -> None:
        """Only `job_ids` of the batch were scheduled (the others were cancelled as it formed); with
        none, it is not out at all."""
        if job_ids:
            self.redis.hset(self.keys.inflight(model), batch_id, json.dumps(list(job_ids)))
        else:
            self.redis.hdel(self.keys.inflight(model), batch_id)

    def batch_out(self, model: str, batch_id: str, *, pipe: Any = None) -> None:
        """The batch is over (or never reached a stage): it leaves the record."""
        (pipe if pipe is not None else self.redis).hdel(self.keys.inflight(model), batch_id)

    def prune_batches(self) -> int:
        """Every model's batches none of whose jobs still progresses leave the record; how many left."""
        pruned = 0
        for model in sorted(map(text_of, self.redis.smembers(self.keys.inflight_models()))):
            entries = self.redis.hgetall(self.keys.inflight(model))
            pipe = self.redis.pipeline(transaction=False)
            for job_ids in entries.values():
                for job_id in json.loads(job_ids):
                    pipe.zscore(self.keys.progress(), job_id)
            scores = iter(pipe.execute())
            dead = []
            for batch_id, job_ids in entries.items():
                progressing = [next(scores) is not None for _ in json.loads(job_ids)]
                if not any(progressing):
                    dead.append(batch_id)
            if dead:
                self.redis.hdel(self.keys.inflight(model), *dead)
                pruned += len(dead)
        return pruned

    def get(self, job_id: str) -> JobRecord | None:
        """The job's record; None once it has expired (or never was)."""
        raw = self.redis.hgetall(self.keys.job(job_id))
        return JobRecord.from_hash(raw) if raw else None

    def get_many(self, job_ids: Sequence[str]) -> list[JobRecord | None]:
        """The records of `job_ids`, in one round trip; None for each that has expired."""
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hgetall(self.keys.job(job_id))
        return [JobRecord.from_hash(raw) if raw else None for raw in pipe.execute()]

    def held_in(self, job_ids: Sequence[str], batch_ids: set[str]) -> dict[str, dict[str, str]]:
        """Of `job_ids`, those scheduled or running in one of `batch_ids`: job id -> its batch and
        status, the guard under which a worker of those batches may still end it."""
        live = (JobStatus.SCHEDULED, JobStatus.RUNNING)
        return {
            r.id: {"batch_id": r.batch_id, "status": str(r.status)}
            for r in self.get_many(job_ids)
            if r is not None and r.batch_id in batch_ids and r.status in live
        }


class AsyncJobStore:
    """The API's job-record operations, over redis.asyncio."""

    def __init__(self, redis: Any, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._admit = Script(redis, ADMIT_LUA)
        self._end = Script(redis, END_LUA)

    async def admit(
        self,
        record: JobRecord,
        *,
        intake: Mapping[str, str],
        class_depth: int,
        overall: int,
        tenant_depth: int,
        ttl_s: int,
        tenant_bytes: int = 0,
        idempotency: tuple[str, str, int] | None = None,
        callback_at: float | None = None,
    ) -> tuple[str, str]:
        """Write a new job's record (living `ttl_s`) and its intake entry if fewer than `class_depth`
        jobs wait in its class, fewer than `overall` in all and fewer than `tenant_depth` of its
        tenant's in its class; with `idempotency` (the key's digest, its value, its ttl) the key too,
        unless it is already held. With `callback_at` the job is registered with the webhook
        dispatcher, scored by that time. Returns the script's outcome and its detail: ('ok', depth),
        ('held', value), ('exists', '') (a job with its id exists), ('overloaded', total),
        ('queue_full', depth) or ('tenant_queue_full', the tenant's waiting jobs of the class), or
        ('tenant_quota', '{bytes} {unix ms}') when the tenant's retained jobs and this one would weigh
        more than `tenant_bytes` (0: no quota): what they weigh, and when the oldest of them expires."""
        args: dict[str, Any] = {
            "class_depth": class_depth,
            "overall": overall,
            "ttl": ttl_s,
            "id": record.id,
            "share": tenant_depth,
            "priority": record.priority,
            "tenant": record.tenant,
            "quota": tenant_bytes,
            "weight": retained_bytes(record),
            "record": _items(record.to_hash()),
            "entry": _items(intake),
        }
        if idempotency is not None:
            args |= {"idempotency_value": idempotency[1], "idempotency_ttl": idempotency[2]}
        if callback_at is not None:
            args["callback_at"] = repr(callback_at)
        keys = {
            "job": self.keys.job(record.id),
            "intake": self.keys.intake(record.priority),
            "streams": [self.keys.intake(p) for p in PRIORITIES],
            "callbacks": self.keys.webhook_jobs(),
            **_waiting_keys(self.keys),
            "retained": self.keys.tenant_retained(record.tenant),
            "retained_bytes": self.keys.tenant_retained_bytes(record.tenant),
            "idempotency": None if idempotency is None else self.keys.idempotency(idempotency[0]),
        }
        outcome, detail = await self._admit(keys=keys, args=args)
        return text_of(outcome), text_of(detail)

    async def forget_embedding(self, job_id: str) -> None:
        """Drop an embeddings job's vectors (up to a MB of JSON) once its one caller has them."""
        await self.redis.hdel(self.keys.job(job_id), "embedding")

    async def cancel(self, job_id: str, *, reason: str, life: Lifetimes) -> tuple[bool, str]:
        """Move the job to `cancelled` and append its final event; (applied, the status it had, ''
        when there is no such job). Its inputs stay while it was running: stage 0 may read them."""
        error = {"code": "cancelled", "message": reason}
        keys, args = _end_call(
            self.keys,
            job_id,
            S.CANCELLED,
            fields={"error": error},
            data=json.dumps(error),
            now=time.time(),
            life=life,
            read=False,
        )
        applied, current = await self._end(keys=keys, args=args)
        return bool(int(applied)), text_of(current)

    async def get(self, job_id: str) -> JobRecord | None:
        """The job's record; None once it has expired (or never was)."""
        raw = await self.redis.hgetall(self.keys.job(job_id))
        return JobRecord.from_hash(raw) if raw else None

    async def get_many(self, job_ids: Sequence[str]) -> list[JobRecord | None]:
        """The records of `job_ids`, in one round trip; None for each that has expired."""
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hgetall(self.keys.job(job_id))
        return [JobRecord.from_hash(raw) if raw else None for raw in await pipe.execute()]
