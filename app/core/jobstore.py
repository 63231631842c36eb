"""The job record's one writer: every write to a job's hash, its event stream, the `progress` set
and the tenants' waiting sets (`tenant_waiting`, kept in step with the status: WAITING_FUNCTION).

Who calls what:
- the API (`AsyncJobStore`): `admit` (the record with its intake entry, at submit, for every job
  kind), `cancel`, `forget_embedding` (an embeddings job's vectors, once its caller has them);
- the batcher (`JobStore`): `enqueue` / `apply` (scheduled, back to queued), `progressed`, `recover`
  (the monitor), `end` (a queued job expires, through `Publisher`);
- the stage and embeddings workers (`JobStore`): `apply` (running), `progressed`, `step` (one decode
  step's tokens, and the end of the sequences it finishes), `set_prompt_tokens` (an embeddings
  job's, once tokenized), `end` (succeeded with a result, failed).

Every move is one Lua script that checks the job's current status and writes the new one with its
timestamp atomically. The states a script may move a job from are generated from `TRANSITIONS`
(app/core/jobs.py), never written by hand, and a final move appends its final event
(`FINAL_EVENT`) in the same script, so a client that reads the event finds the final record.
`tests/unit/test_job_writes.py` fails if any other module of `app/` writes these keys.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from string import Template
from typing import TYPE_CHECKING, Any

from app.core.grammar import Grammar
from app.core.jobs import (
    FINAL_EVENT,
    TIMESTAMP_FIELD,
    WAITING,
    JobStatus,
    Transition,
    check_result,
    decode_record,
    encode_field,
    predecessors,
    text_of,
)
from app.core.keys import PRIORITIES, Keys
from app.core.sampling import SamplingParams

if TYPE_CHECKING:
    from app.core.config import Settings

S = JobStatus

# --- the record ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class JobRequest:
    """What a generation job asked for: its sampling and stopping rules (the record's `request`).
    Stored flat; a field at its default is left out, so a request that asks for nothing new is
    the JSON the record has always held."""

    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # Structured outputs: the text is constrained to this grammar (app.workers.grammar).
    grammar: Grammar | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True  # as vLLM's: special tokens are left out of the text

    def to_json(self) -> str:
        value: dict[str, Any] = {"max_tokens": self.max_tokens, **self.sampling.to_dict()}
        if self.grammar is not None:
            value["grammar"] = self.grammar.to_dict()
        value |= {"stop": list(self.stop), "ignore_eos": self.ignore_eos, "min_tokens": self.min_tokens}
        if not self.skip_special_tokens:
            value["skip_special_tokens"] = False
        return json.dumps(value)

    @classmethod
    def from_json(cls, text: str) -> JobRequest:
        """A stored request; fields added after it was written take their defaults."""
        value = json.loads(text)
        return cls(
            max_tokens=int(value["max_tokens"]),
            sampling=SamplingParams.from_dict(value),
            grammar=Grammar.from_dict(value["grammar"]) if value.get("grammar") else None,
            stop=tuple(value.get("stop") or ()),
            ignore_eos=bool(value.get("ignore_eos")),
            min_tokens=int(value.get("min_tokens") or 0),
            skip_special_tokens=bool(value.get("skip_special_tokens", True)),
        )


def _float(text: str) -> float:
    return float(text)


def _json_list(text: str) -> tuple[Any, ...]:
    return tuple(json.loads(text))


def _dumps_list(value: Iterable[Any]) -> str:
    return json.dumps(list(value))


# field -> (text -> value, value -> text), for the fields that are not plain text. The encodings
# are the ones the record has always had: a rolling upgrade reads and writes the same hash.
_CODECS: dict[str, tuple[Any, Any]] = {
    "status": (JobStatus, str),
    "created_at": (_float, repr),
    "deadline": (_float, repr),
    "request": (JobRequest.from_json, JobRequest.to_json),
    "prompt_ids": (_json_list, _dumps_list),
    "prompt_tokens": (int, str),
    "completion_tokens": (int, str),
    "attempts": (int, str),
    "callback_events": (_json_list, _dumps_list),
    "input": (_json_list, _dumps_list),
    "batch_size": (int, str),
    "error": (json.loads, encode_field),
    **{name: (_float, encode_field) for name in set(TIMESTAMP_FIELD.values()) | {"first_token_at"}},
}


@dataclass(frozen=True, kw_only=True)
class JobRecord:
    """The job hash (`job:{id}`), typed. A field that is None is absent from the hash. Fields are
    in the order they are written at submit; those after `input` are written as the job moves."""

    id: str
    status: JobStatus
    model: str
    tenant: str
    kind: str | None = None  # "embedding"; absent for a generation job
    priority: str
    created_at: float
    request: JobRequest | None = None
    prompt_ids: tuple[int, ...] | None = None  # dropped once the job has ended
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    text: str | None = None
    attempts: int | None = None
    route: str | None = None  # the route that chose `model`, and why
    route_reason: str | None = None
    deadline: float | None = None  # unix time by which it must have started
    callback_url: str | None = None
    callback_events: tuple[str, ...] | None = None
    input: tuple[str, ...] | None = None  # an embeddings job's texts, dropped once it has ended
    queued_at: float | None = None
    batch_id: str | None = None
    batch_size: int | None = None
    scheduled_at: float | None = None
    started_at: float | None = None
    recovered_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    finish_reason: str | None = None
    error: dict[str, Any] | None = None
    embedding: str | None = None  # JSON vectors, until the API hands them over
    # Fields this version does not know (written by a newer one): kept as they are.
    other: Mapping[str, str] = field(default_factory=dict)

    def to_hash(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for name in _FIELDS:
            value = getattr(self, name)
            if value is not None:
                out[name] = _CODECS[name][1](value) if name in _CODECS else value
        return {**out, **self.other}

    @classmethod
    def from_hash(cls, raw: Mapping[Any, Any]) -> JobRecord:
        record = decode_record(raw)
        known: dict[str, Any] = {
            k: (_CODECS[k][0](v) if k in _CODECS else v) for k, v in record.items() if k in _FIELDS
        }
        other = {k: v for k, v in record.items() if k not in _FIELDS}
        return cls(**known, other=other)


_FIELDS = tuple(name for name in JobRecord.__dataclass_fields__ if name != "other")


# --- the scripts -----------------------------------------------------------------------------------


def _lua_set(statuses: Iterable[str]) -> str:
    """A Lua table used as a set of statuses: `{['running'] = true}`."""
    return "{" + ", ".join(f"['{s}'] = true" for s in sorted(statuses)) + "}"


def _lua(text: str) -> str:
    """Script text with the lifecycle's names filled in from the table (`$RUNNING`, `$LIVE`, ...)."""
    names: dict[str, str] = {s.name: f"'{s}'" for s in JobStatus}
    names |= {f"{s.name}_AT": f"'{f}'" for s, f in TIMESTAMP_FIELD.items()}
    names |= {f"{s.name}_EVENT": f"'{e}'" for s, e in FINAL_EVENT.items()}
    names["LIVE"] = _lua_set(str(s) for s in JobStatus if not s.is_finished)
    # A token is written only in a state the job may succeed from (running).
    names["STREAMING"] = _lua_set(predecessors(S.SUCCEEDED))
    # The monitor moves a stalled job to recovering, or to failed once out of attempts: only from
    # a state both moves may leave.
    names["RECOVERABLE"] = _lua_set(set(predecessors(S.RECOVERING)) & set(predecessors(S.FAILED)))
    names["WAITING"] = _lua_set(str(s) for s in WAITING)
    return Template(text).substitute(names)


# The tenants' waiting jobs (admission's tenant share, app/core/admission.py): a job is a member of
# `tenant_waiting` (and of `tenant_waiting_expiry`, scored by when its record expires) exactly while
# its status is one of `WAITING` (it has an entry in its class's intake stream), because every
# script that writes a status here adds or removes the member in the same script: the admit script
# (queued), `transition` (any move: into queued after a dispatch is undone; out of queued or
# recovering when scheduled, cancelled, expired or failed) and the recovery script (recovering).
# Adding and removing are idempotent, so the count is the number of members.
# A member outlives its job only if the record expires while the job waits (no move took it out):
# the admit script drops those first. A member names its tenant with its length, so that no tenant's
# name can be a prefix of another's range.
#
# waiting_name(priority, tenant, id): the member; with id '' the prefix of the tenant's range.
# waits(job, waiting, expiry, on): the job (its record's id, priority, tenant) enters or leaves.
# moved(job, waiting, expiry, from, to): after a move applied, the same when it crosses WAITING.
WAITING_FUNCTION = _lua(
    """
local function waiting_name(priority, tenant, id)
  return priority .. ' ' .. #tenant .. ':' .. tenant .. ' ' .. id
end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function waits(job, waiting, expiry, on)
  local rec = redis.call('HMGET', job, 'id', 'priority', 'tenant')
  if not rec[1] or not rec[2] then return end
  local name = waiting_name(rec[2], rec[3] or '', rec[1])
  if on then
    local ttl = redis.call('PTTL', job)
    redis.call('ZADD', waiting, 0, name)
    redis.call('ZADD', expiry, ttl >= 0 and now_ms() + ttl or '+inf', name)
  else
    redis.call('ZREM', waiting, name)
    redis.call('ZREM', expiry, name)
  end
end
local function moved(job, waiting, expiry, from, to)
  local waiting_states = $WAITING
  if (waiting_states[from] or false) ~= (waiting_states[to] or false) then
    waits(job, waiting, expiry, waiting_states[to] or false)
  end
end
"""
)


# transition(key, o, waiting, expiry): ARGV[o+1..] = target, n, n allowed predecessors, g, g guard
# field/value pairs (the record must hold these values), then field/value pairs to write; `waiting`
# and `expiry`: the tenants' waiting sets, kept in step with the move (WAITING_FUNCTION, which a
# script includes before this). Returns {1, previous} when applied, {0, current-or-empty} when refused.
TRANSITION_FUNCTION = """
local function transition(key, o, waiting, expiry)
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
      moved(key, waiting, expiry, cur, ARGV[o + 1])
      return {1, cur}
    end
  end
  return {0, cur}
end
"""
TRANSITION_LUA = WAITING_FUNCTION + TRANSITION_FUNCTION + "return transition(KEYS[1], 0, KEYS[2], KEYS[3])"

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
#
# Its Idempotency-Key expires with it (at most `ttl` from now), and its member of the tenant's
# retained set (the quota, ADMIT_LUA) is rescored to the record's new expiry: the admit script
# wrote both names into the record.
ENDED_FUNCTION = _lua(
    """
local function ended(job, events, ttl, was)
  if was ~= $RUNNING then redis.call('HDEL', job, 'prompt_ids') end
  redis.call('HDEL', job, 'input')
  redis.call('EXPIRE', job, ttl)
  redis.call('EXPIRE', events, ttl)
  local held = redis.call('HMGET', job, 'idempotency_key', 'retained_in', 'retained_as')
  if held[1] and redis.call('TTL', held[1]) > tonumber(ttl) then redis.call('EXPIRE', held[1], ttl) end
  if held[2] then
    local t = redis.call('TIME')
    local expires = (tonumber(t[1]) + tonumber(ttl)) * 1000 + math.floor(tonumber(t[2]) / 1000)
    redis.call('ZADD', held[2], 'XX', expires, held[3])
  end
end
"""
)

# A job's final move and its final event, together or not at all. KEYS = job hash, event stream,
# progress set, the tenants' waiting sets (2). ARGV[1..7] = event, data, stream maxlen, ended ttl
# (record and stream), announce channel, job id, read ('1': the caller is the worker that has read
# the job's inputs, so they go whatever state it left); then the transition's arguments (above).
# Returns the transition's result.
END_LUA = (
    WAITING_FUNCTION
    + TRANSITION_FUNCTION
    + ENDED_FUNCTION
    + """
local done = transition(KEYS[1], 7, KEYS[4], KEYS[5])
if done[1] == 1 then
  redis.call('XADD', KEYS[2], 'MAXLEN', ARGV[3], '*', 'event', ARGV[1], 'data', ARGV[2])
  ended(KEYS[1], KEYS[2], ARGV[4], ARGV[7] == '1' and '' or done[2])
  redis.call('ZREM', KEYS[3], ARGV[6])
  redis.call('PUBLISH', ARGV[5], ARGV[1])
end
return done
"""
)

# One decode step. KEYS[1] = the progress sorted set; then, per row, the job hash and its event
# stream. ARGV[1..5] = now, stream maxlen, stream ttl, announce channel prefix, ended ttl; then 8
# values per row: job id, batch id, emit (0/1; 2: a `prompt` event of this data, before the job's
# own row), index, token event data, completion text, completion tokens, finish reason ('' while it
# goes on). Returns the ids of the rows whose job is no longer
# theirs. A row whose job ended meanwhile (cancelled while running) loses its prompt here: this
# batch's prefill has read it (ENDED_FUNCTION).
STEP_LUA = ENDED_FUNCTION + _lua(
    """
local now, maxlen, ttl, announce, ended_ttl = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local live, streaming = $LIVE, $STREAMING
local gone = {}
for r = 0, (#KEYS - 1) / 2 - 1 do
  local job, events = KEYS[2 + 2 * r], KEYS[3 + 2 * r]
  local a = 6 + 8 * r
  local id, batch, emit, index = ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3]
  local rec = redis.call('HMGET', job, 'status', 'batch_id')
  if not streaming[rec[1]] or rec[2] ~= batch then
    table.insert(gone, id)
    if rec[1] and rec[2] == batch and not live[rec[1]] then  -- it ended in this batch
      redis.call('HDEL', job, 'prompt_ids')
    end
  elseif emit == '2' then  -- the prompt's log probabilities (echo), before its first token
    redis.call('XADD', events, 'MAXLEN', maxlen, '*', 'event', 'prompt', 'data', ARGV[a + 4])
    redis.call('EXPIRE', events, ttl)
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
      -- streaming -> succeeded (the move TRANSITIONS allows), then the final event
      redis.call('HSET', job, 'status', $SUCCEEDED, $SUCCEEDED_AT, now, 'finish_reason', ARGV[a + 7])
      redis.call('XADD', events, 'MAXLEN', maxlen, '*', 'event', $SUCCEEDED_EVENT, 'data', '{}')
      ended(job, events, ended_ttl, '')
      redis.call('ZREM', KEYS[1], id)
      redis.call('PUBLISH', announce .. id, $SUCCEEDED_EVENT)
    else
      redis.call('ZADD', KEYS[1], now, id)
    end
  end
end
return gone
"""
)

# The monitor's move of one stalled job.
# KEYS = progress set, job hash, event stream, intake stream of its class, in-flight hash of its model,
# the tenants' waiting sets (2).
# ARGV = job id, stalled-before (unix), max attempts, now, stream maxlen, ended ttl, announce
# channel, error JSON, then the intake entry's field/value pairs.
# Moves a recoverable job to recovering (re-queued) or to failed (its inputs dropped: a stalled
# batch read them long ago); returns the new status or ''.
RECOVER_LUA = (
    WAITING_FUNCTION
    + ENDED_FUNCTION
    + _lua(
        """
local job = ARGV[1]
local score = redis.call('ZSCORE', KEYS[1], job)
if not score or tonumber(score) > tonumber(ARGV[2]) then return '' end
redis.call('ZREM', KEYS[1], job)
local rec = redis.call('HMGET', KEYS[2], 'status', 'attempts', 'batch_id', 'completion_tokens')
local recoverable = $RECOVERABLE
if not recoverable[rec[1]] then return '' end
if rec[3] then redis.call('HDEL', KEYS[5], rec[3]) end
local attempts = tonumber(rec[2] or '0') + 1
if attempts >= tonumber(ARGV[3]) then
  redis.call('HSET', KEYS[2], 'status', $FAILED, $FAILED_AT, ARGV[4], 'attempts', attempts,
             'error', ARGV[8])
  redis.call('XADD', KEYS[3], 'MAXLEN', ARGV[5], '*', 'event', $FAILED_EVENT, 'data', ARGV[8])
  ended(KEYS[2], KEYS[3], ARGV[6], '')
  redis.call('PUBLISH', ARGV[7], $FAILED_EVENT)
  return $FAILED
end
redis.call('HSET', KEYS[2], 'status', $RECOVERING, $RECOVERING_AT, ARGV[4], 'attempts', attempts)
-- Where the stream picks up: the next token's index. A client that saw tokens up to index-1 knows
-- what follows is a continuation, not a replay (a seeded job draws exactly what it would have).
local resumed = '{"index":' .. tonumber(rec[4] or '0') .. ',"attempt":' .. attempts .. '}'
redis.call('XADD', KEYS[3], 'MAXLEN', ARGV[5], '*', 'event', 'recovered', 'data', resumed)
redis.call('PUBLISH', ARGV[7], 'recovered')
local entry = {}
for i = 9, #ARGV do table.insert(entry, ARGV[i]) end
table.insert(entry, 'attempts')
table.insert(entry, tostring(attempts))
redis.call('XADD', KEYS[4], '*', unpack(entry))
waits(KEYS[2], KEYS[6], KEYS[7], true)
return $RECOVERING
"""
    )
)

# A new job: its record, its intake entry and (with one) its Idempotency-Key, if the depth limits
# (admission's gates 3 and 4, app/core/admission.py), the tenant's share of its class and the
# tenant's retained-bytes quota still hold.
# KEYS[1] = job hash, KEYS[2] = the job's intake stream, KEYS[3 .. 2+c] = every intake stream,
# KEYS[3+c] = the webhook dispatcher's set of jobs with a callback, KEYS[4+c], KEYS[5+c] = the
# tenants' waiting sets (WAITING_FUNCTION), KEYS[6+c], KEYS[7+c] = the tenant's retained set and its
# byte count (Keys.tenant_retained), KEYS[8+c] = the Idempotency-Key's key (absent without one).
# ARGV[1] = c, [2] = class depth limit, [3] = overall limit, [4] = job ttl, [5] = idempotency value,
# [6] = idempotency ttl, [7] = r, [8] = webhook registration score ('' = no callback), [9] = job id,
# [10] = the tenant's share of the class (jobs), [11] = the job's class, [12] = its tenant,
# [13] = the tenant's retained-bytes quota (0: none), [14] = the bytes this job may weigh,
# then r record field/value items, then the intake entry's items.
# Returns {'held', value} | {'exists', ''} | {'overloaded', total} | {'queue_full', depth} |
# {'tenant_queue_full', the tenant's waiting jobs of the class} |
# {'tenant_quota', '{retained bytes} {when its oldest job expires, unix ms}'} | {'ok', depth}.
ADMIT_LUA = (
    WAITING_FUNCTION
    + """
local c = tonumber(ARGV[1])
local waiting, expiry = KEYS[4 + c], KEYS[5 + c]
local retained, retained_bytes = KEYS[6 + c], KEYS[7 + c]
-- A job id is written once: a batch's line fed again after a feeder died finds its job here.
if redis.call('EXISTS', KEYS[1]) == 1 then return {'exists', ''} end
local idem = KEYS[8 + c]
if idem then
  local held = redis.call('GET', idem)
  if held then return {'held', held} end
end
local total = 0
for i = 3, 2 + c do total = total + redis.call('XLEN', KEYS[i]) end
if total >= tonumber(ARGV[3]) then return {'overloaded', total} end
local depth = redis.call('XLEN', KEYS[2])
if depth >= tonumber(ARGV[2]) then return {'queue_full', depth} end
-- Members whose record expired while their job waited (a few per submit: the work stays bounded).
local stale = redis.call('ZRANGEBYSCORE', expiry, '-inf', '(' .. now_ms(), 'LIMIT', 0, 16)
if #stale > 0 then
  redis.call('ZREM', waiting, unpack(stale))
  redis.call('ZREM', expiry, unpack(stale))
end
local prefix = waiting_name(ARGV[11], ARGV[12], '')
local mine = redis.call('ZLEXCOUNT', waiting, '[' .. prefix, '(' .. prefix .. '\\255')
if mine >= tonumber(ARGV[10]) then return {'tenant_queue_full', mine} end
-- The tenant's jobs whose record has expired leave its retained bytes (a few per submit).
local now = now_ms()
local gone = redis.call('ZRANGEBYSCORE', retained, '-inf', '(' .. now, 'LIMIT', 0, 64)
if #gone > 0 then
  local freed = 0
  for _, member in ipairs(gone) do freed = freed + tonumber(string.match(member, '^%d+')) end
  redis.call('ZREM', retained, unpack(gone))
  redis.call('DECRBY', retained_bytes, freed)
end
local weight = tonumber(ARGV[14])
local held_bytes = tonumber(redis.call('GET', retained_bytes) or '0')
if tonumber(ARGV[13]) > 0 and held_bytes + weight > tonumber(ARGV[13]) then
  local oldest = redis.call('ZRANGE', retained, 0, 0, 'WITHSCORES')
  return {'tenant_quota', held_bytes .. ' ' .. (oldest[2] or now)}
end
local r = tonumber(ARGV[7])
redis.call('HSET', KEYS[1], unpack(ARGV, 15, 14 + r))
local member = weight .. ' ' .. ARGV[9]
redis.call('HSET', KEYS[1], 'retained_in', retained, 'retained_as', member)
redis.call('EXPIRE', KEYS[1], ARGV[4])
redis.call('XADD', KEYS[2], '*', unpack(ARGV, 15 + r, #ARGV))
waits(KEYS[1], waiting, expiry, true)
redis.call('ZADD', retained, now + 1000 * tonumber(ARGV[4]), member)
redis.call('INCRBY', retained_bytes, weight)
redis.call('EXPIRE', retained, ARGV[4])
redis.call('EXPIRE', retained_bytes, ARGV[4])
if idem then
  redis.call('SET', idem, ARGV[5], 'EX', ARGV[6])
  redis.call('HSET', KEYS[1], 'idempotency_key', idem)
end
if ARGV[8] ~= '' then redis.call('ZADD', KEYS[3 + c], ARGV[8], ARGV[9]) end  -- Webhooks
return {'ok', depth}
"""
)


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _items(mapping: Mapping[str, Any]) -> list[Any]:
    return [x for pair in mapping.items() for x in pair]


# Fields the admit script adds to a record beside JobRecord's (in its `other`): the keys that end
# with the job (its tenant's retained set and its member there, its Idempotency-Key).
ADMIT_FIELDS = ("retained_in", "retained_as", "idempotency_key")

# What a job may weigh in Redis, for its tenant's retained-bytes quota: its record with its texts, an
# event stream's first node (Redis allocates it whole, ~4.7 KB) and ~80 bytes an event, measured
# on Redis 7 (docs/operations.md, "Sizing"); while it waits, its prompt's token ids too.
RECORD_BYTES = 7_000
BYTES_PER_TOKEN_EVENT = 80
BYTES_PER_PROMPT_TOKEN = 4


def retained_bytes(record: JobRecord) -> int:
    """An upper estimate of what `record`'s job holds in Redis at its largest: every token it may
    generate streamed, its prompt (or embeddings input) still held."""
    tokens = record.request.max_tokens if record.request is not None else 0
    held = BYTES_PER_PROMPT_TOKEN * len(record.prompt_ids or ()) + sum(
        len(t.encode()) for t in record.input or ()
    )
    return RECORD_BYTES + BYTES_PER_TOKEN_EVENT * tokens + held


# A job's event stream holds its tokens and a few other events (recovered, the final one, ...);
# its cap leaves room for these beside `max_tokens_limit` tokens.
EVENTS_BESIDE_TOKENS = 16


@dataclass(frozen=True)
class Lifetimes:
    """How long a job's record and stream live, and how long its stream may grow."""

    ttl_s: int  # while the job is live
    ended_ttl_s: int  # once it has ended
    stream_maxlen: int

    @classmethod
    def of(cls, settings: Settings) -> Lifetimes:
        """A job's lifetimes as the settings make them: derived here once, for the API, the batcher
        and the workers alike."""
        maxlen = settings.max_tokens_limit + EVENTS_BESIDE_TOKENS
        return cls(ttl_s=settings.job_ttl_s, ended_ttl_s=settings.ended_job_ttl_s, stream_maxlen=maxlen)


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
) -> tuple[list[str], list[Any]]:
    """END_LUA's keys and arguments for one job's final move to `status`; `data`: its final event's
    data, JSON."""
    transition = Transition(job_id, status, fields, when or {})
    args: list[Any] = [FINAL_EVENT[status], data, life.stream_maxlen, life.ended_ttl_s]
    args += [keys.announce(job_id), job_id, "1" if read else "0", *transition.script_args(now)]
    return [keys.job(job_id), keys.events(job_id), keys.progress(), *_waiting_keys(keys)], args


def _waiting_keys(keys: Keys) -> list[str]:
    """The tenants' waiting sets, which every script that moves a job keeps in step (WAITING_FUNCTION)."""
    return [keys.tenant_waiting(), keys.tenant_waiting_expiry()]


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
        self._transition = redis.register_script(TRANSITION_LUA)
        self._end = redis.register_script(END_LUA)
        self._step = redis.register_script(STEP_LUA)
        self._recover = redis.register_script(RECOVER_LUA)

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
        keys = [self.keys.job(transition.job_id), *_waiting_keys(self.keys)]
        self._transition(keys=keys, args=transition.script_args(now), client=pipe)

    def progressed(self, job_ids: Sequence[str], now: float, *, pipe: Any = None) -> None:
        """Score jobs in `progress` (dispatched, prefill started): the monitor's stall clock restarts.
        With `pipe`, added to the caller's pipeline (the batcher's dispatch transaction)."""
        (pipe or self.redis).zadd(self.keys.progress(), dict.fromkeys(job_ids, now))

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
        keys, args = [self.keys.progress()], [repr(time.time()), life.stream_maxlen, life.ttl_s]
        args += [self.keys.announce(""), life.ended_ttl_s]
        for out in outs:
            if out.prompt_logprobs is not None:
                keys += [self.keys.job(out.job_id), self.keys.events(out.job_id)]
                args += [out.job_id, out.batch_id, 2, -1, _json({"prompt_logprobs": out.prompt_logprobs})]
                args += ["", 0, ""]
            keys += [self.keys.job(out.job_id), self.keys.events(out.job_id)]
            data: dict[str, Any] = {"index": out.index, "text": out.text, "token_id": out.token_id}
            if out.logprob is not None:
                data |= {"logprob": out.logprob, "top_logprobs": [list(pair) for pair in out.top_logprobs]}
            count = out.index + int(out.emit) if out.finish_reason else out.index + 1
            args += [out.job_id, out.batch_id, int(out.emit), out.index, _json(data)]
            args += [out.completion_text, count, out.finish_reason or ""]
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
        keys = [self.keys.progress(), self.keys.job(job_id), self.keys.events(job_id)]
        keys += [self.keys.intake(priority), self.keys.inflight(model), *_waiting_keys(self.keys)]
        args: list[Any] = [job_id, stalled_before, max_attempts, repr(now), life.stream_maxlen]
        args += [life.ended_ttl_s, self.keys.announce(job_id), json.dumps(error), *_items(entry)]
        return text_of(self._recover(keys=keys, args=args))

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


class AsyncJobStore:
    """The API's job-record operations, over redis.asyncio."""

    def __init__(self, redis: Any, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._admit = redis.register_script(ADMIT_LUA)
        self._end = redis.register_script(END_LUA)

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
        keys = [self.keys.job(record.id), self.keys.intake(record.priority)]
        keys += [self.keys.intake(p) for p in PRIORITIES]
        keys += [self.keys.webhook_jobs(), *_waiting_keys(self.keys)]
        keys += [self.keys.tenant_retained(record.tenant), self.keys.tenant_retained_bytes(record.tenant)]
        value, key_ttl = "", 0
        if idempotency is not None:
            keys.append(self.keys.idempotency(idempotency[0]))
            value, key_ttl = idempotency[1], idempotency[2]
        items = _items(record.to_hash())
        args: list[Any] = [len(PRIORITIES), class_depth, overall, ttl_s, value, key_ttl, len(items)]
        args += ["" if callback_at is None else repr(callback_at), record.id]
        args += [tenant_depth, record.priority, record.tenant, tenant_bytes, retained_bytes(record)]
        args += [*items, *_items(intake)]
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

    async def get(self, job_id: str) -> dict[str, str] | None:
        raw = await self.redis.hgetall(self.keys.job(job_id))
        return decode_record(raw) if raw else None
