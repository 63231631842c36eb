"""The job store's Lua scripts (app/core/jobstore.py runs them; no other module may register them:
tests/unit/test_job_writes.py). The states a script may move a job from, and the names of statuses,
timestamps and final events, are filled in from the lifecycle's table (app/core/jobs.py), never
written by hand.

Every script reads its keys by name and its arguments as one object (`app/core/scripts.py`):
`K.job`, `K.events`, `A.maxlen`, `A.move.to`, never a position computed from counts."""

from __future__ import annotations

from collections.abc import Iterable
from string import Template

from app.core.jobs import FINAL_EVENT, TIMESTAMP_FIELD, WAITING, JobStatus, predecessors

S = JobStatus


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
# (queued) and `move` (every move: into queued after a dispatch is undone, into recovering when the
# monitor re-queues a job; out of queued or recovering when scheduled, cancelled, expired or failed).
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


# Every status write is a move, and every move is `move` (the admit script writes a new record's
# first status with the record): move(key, to, from, guard, fields, waiting, expiry) writes status
# `to` and the field/value list `fields` if the job's status is in the set `from` and its record
# holds `guard`'s field = value pairs, and keeps the tenants' waiting sets in step (WAITING_FUNCTION,
# which a script includes before this; `waiting` and `expiry` may be nil for a move that never
# crosses WAITING). Returns {1, previous} when applied, {0, current-or-empty} when refused.
#
# transition(key, m, waiting, expiry): `move` with a requested move as `Transition.script_move`
# writes it: m.to, m.from (a list of statuses), m.guard (field -> value), m.fields (field/value list).
TRANSITION_FUNCTION = """
local function move(key, to, from, guard, fields, waiting, expiry)
  local cur = redis.call('HGET', key, 'status')
  if not cur then return {0, ''} end
  for field, value in pairs(guard) do
    if redis.call('HGET', key, field) ~= value then return {0, cur} end
  end
  if not from[cur] then return {0, cur} end
  redis.call('HSET', key, 'status', to)
  if #fields > 0 then redis.call('HSET', key, unpack(fields)) end
  moved(key, waiting, expiry, cur, to)
  return {1, cur}
end
local function transition(key, m, waiting, expiry)
  local from = {}
  for _, status in ipairs(m.from) do from[status] = true end
  return move(key, m.to, from, m.guard, m.fields, waiting, expiry)
end
"""
# One requested move. K: job, waiting, expiry (the tenants' waiting sets). A.move: the move.
TRANSITION_LUA = (
    WAITING_FUNCTION + TRANSITION_FUNCTION + "return transition(K.job, A.move, K.waiting, K.expiry)"
)

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

# A job's final move and its final event, together or not at all. K: job, events (its stream),
# progress, waiting, expiry. A: event and data (the final event), maxlen (the stream's), ttl (the
# ended record's and stream's), announce (the channel), id, read (true: the caller is the worker that
# has read the job's inputs, so they go whatever state it left), move (the transition, above).
# Returns the transition's result.
END_LUA = (
    WAITING_FUNCTION
    + TRANSITION_FUNCTION
    + ENDED_FUNCTION
    + """
local done = transition(K.job, A.move, K.waiting, K.expiry)
if done[1] == 1 then
  redis.call('XADD', K.events, 'MAXLEN', A.maxlen, '*', 'event', A.event, 'data', A.data)
  ended(K.job, K.events, A.ttl, A.read and '' or done[2])
  redis.call('ZREM', K.progress, A.id)
  redis.call('PUBLISH', A.announce, A.event)
end
return done
"""
)

# One decode step. K: progress, and per row its job's hash and event stream (K.jobs[r],
# K.events[r]). A: now, maxlen (the streams'), ttl (a live stream's), announce (the channels'
# prefix), ended_ttl, rows: per row id, batch, emit (0/1; 2: a `prompt` event of this data, before
# the job's own row), index, data (the token event's), text (the completion so far), tokens (its
# count), finish (its finish reason; '' while it goes on). Returns the ids of the rows whose job is
# no longer theirs. A row whose job ended meanwhile (cancelled while running) loses its prompt here:
# this batch's prefill has read it (ENDED_FUNCTION).
STEP_LUA = (
    WAITING_FUNCTION
    + TRANSITION_FUNCTION
    + ENDED_FUNCTION
    + _lua(
        """
local live, streaming = $LIVE, $STREAMING
local gone = {}
for r, row in ipairs(A.rows) do
  local job, events = K.jobs[r], K.events[r]
  local rec = redis.call('HMGET', job, 'status', 'batch_id')
  if not streaming[rec[1]] or rec[2] ~= row.batch then
    table.insert(gone, row.id)
    if rec[1] and rec[2] == row.batch and not live[rec[1]] then  -- it ended in this batch
      redis.call('HDEL', job, 'prompt_ids')
    end
  elseif row.emit == 2 then  -- the prompt's log probabilities (echo), before its first token
    redis.call('XADD', events, 'MAXLEN', A.maxlen, '*', 'event', 'prompt', 'data', row.data)
    redis.call('EXPIRE', events, A.ttl)
  else
    if row.emit == 1 then
      redis.call('XADD', events, 'MAXLEN', A.maxlen, '*', 'event', 'token', 'data', row.data)
      if row.index == 0 then
        redis.call('EXPIRE', events, A.ttl)
        redis.call('HSET', job, 'first_token_at', A.now)
      end
      redis.call('PUBLISH', A.announce .. row.id, 'token')
    end
    redis.call('HSET', job, 'text', row.text, 'completion_tokens', row.tokens)
    if row.finish ~= '' then
      -- streaming -> succeeded (the move TRANSITIONS allows), then the final event
      move(job, $SUCCEEDED, streaming, {}, {$SUCCEEDED_AT, A.now, 'finish_reason', row.finish}, nil, nil)
      redis.call('XADD', events, 'MAXLEN', A.maxlen, '*', 'event', $SUCCEEDED_EVENT, 'data', '{}')
      ended(job, events, A.ended_ttl, '')
      redis.call('ZREM', K.progress, row.id)
      redis.call('PUBLISH', A.announce .. row.id, $SUCCEEDED_EVENT)
    else
      redis.call('ZADD', K.progress, A.now, row.id)
    end
  end
end
return gone
"""
    )
)

# The monitor's move of one stalled job. K: progress, job, events, intake (its class's stream),
# inflight (its model's batch record), waiting, expiry. A: id, stalled_before (unix), max_attempts,
# now, maxlen, ttl (the ended record's), announce, error (JSON), entry (the intake entry's
# field/value list).
# Moves a recoverable job to recovering (re-queued) or to failed (its inputs dropped: a stalled
# batch read them long ago); returns the new status or ''.
RECOVER_LUA = (
    WAITING_FUNCTION
    + TRANSITION_FUNCTION
    + ENDED_FUNCTION
    + _lua(
        """
local score = redis.call('ZSCORE', K.progress, A.id)
if not score or tonumber(score) > tonumber(A.stalled_before) then return '' end
redis.call('ZREM', K.progress, A.id)
local rec = redis.call('HMGET', K.job, 'status', 'attempts', 'batch_id', 'completion_tokens')
local recoverable = $RECOVERABLE
if not recoverable[rec[1]] then return '' end
if rec[3] then redis.call('HDEL', K.inflight, rec[3]) end
local attempts = tonumber(rec[2] or '0') + 1
if attempts >= A.max_attempts then
  move(K.job, $FAILED, recoverable, {}, {$FAILED_AT, A.now, 'attempts', attempts, 'error', A.error},
       K.waiting, K.expiry)
  redis.call('XADD', K.events, 'MAXLEN', A.maxlen, '*', 'event', $FAILED_EVENT, 'data', A.error)
  ended(K.job, K.events, A.ttl, '')
  redis.call('PUBLISH', A.announce, $FAILED_EVENT)
  return $FAILED
end
move(K.job, $RECOVERING, recoverable, {}, {$RECOVERING_AT, A.now, 'attempts', attempts}, K.waiting, K.expiry)
-- Where the stream picks up: the next token's index. A client that saw tokens up to index-1 knows
-- what follows is a continuation, not a replay (a seeded job draws exactly what it would have).
local resumed = '{"index":' .. tonumber(rec[4] or '0') .. ',"attempt":' .. attempts .. '}'
redis.call('XADD', K.events, 'MAXLEN', A.maxlen, '*', 'event', 'recovered', 'data', resumed)
redis.call('PUBLISH', A.announce, 'recovered')
local entry = A.entry
table.insert(entry, 'attempts')
table.insert(entry, tostring(attempts))
redis.call('XADD', K.intake, '*', unpack(entry))
return $RECOVERING
"""
    )
)

# A new job: its record, its intake entry and (with one) its Idempotency-Key, if the depth limits
# (admission's gates 3 and 4, app/core/admission.py), the tenant's share of its class and the
# tenant's retained-bytes quota still hold.
# K: job, intake (the job's class's stream), streams (every class's), callbacks (the webhook
# dispatcher's set of jobs with a callback), waiting, expiry (WAITING_FUNCTION), retained and
# retained_bytes (the tenant's retained set and its byte count, Keys.tenant_retained), idempotency
# (the Idempotency-Key's key; absent without one).
# A: class_depth, overall (the depth limits), ttl (the job's), idempotency_value, idempotency_ttl,
# callback_at (the registration's score; absent: no callback), id, share (the tenant's share of the
# class, in jobs), priority, tenant, quota (the tenant's retained bytes; 0: none), weight (the bytes
# this job may weigh), record and entry (field/value lists).
# Returns {'held', value} | {'exists', ''} | {'overloaded', total} | {'queue_full', depth} |
# {'tenant_queue_full', the tenant's waiting jobs of the class} |
# {'tenant_quota', '{retained bytes} {when its oldest job expires, unix ms}'} | {'ok', depth}.
ADMIT_LUA = (
    WAITING_FUNCTION
    + """
-- A job id is written once: a batch's line fed again after a feeder died finds its job here.
if redis.call('EXISTS', K.job) == 1 then return {'exists', ''} end
if K.idempotency then
  local held = redis.call('GET', K.idempotency)
  if held then return {'held', held} end
end
local total = 0
for _, stream in ipairs(K.streams) do total = total + redis.call('XLEN', stream) end
if total >= A.overall then return {'overloaded', total} end
local depth = redis.call('XLEN', K.intake)
if depth >= A.class_depth then return {'queue_full', depth} end
-- Members whose record expired while their job waited (a few per submit: the work stays bounded).
local stale = redis.call('ZRANGEBYSCORE', K.expiry, '-inf', '(' .. now_ms(), 'LIMIT', 0, 16)
if #stale > 0 then
  redis.call('ZREM', K.waiting, unpack(stale))
  redis.call('ZREM', K.expiry, unpack(stale))
end
local prefix = waiting_name(A.priority, A.tenant, '')
local mine = redis.call('ZLEXCOUNT', K.waiting, '[' .. prefix, '(' .. prefix .. '\\255')
if mine >= A.share then return {'tenant_queue_full', mine} end
-- The tenant's jobs whose record has expired leave its retained bytes (a few per submit).
local now = now_ms()
local gone = redis.call('ZRANGEBYSCORE', K.retained, '-inf', '(' .. now, 'LIMIT', 0, 64)
if #gone > 0 then
  local freed = 0
  for _, member in ipairs(gone) do freed = freed + tonumber(string.match(member, '^%d+')) end
  redis.call('ZREM', K.retained, unpack(gone))
  redis.call('DECRBY', K.retained_bytes, freed)
end
local held_bytes = tonumber(redis.call('GET', K.retained_bytes) or '0')
if A.quota > 0 and held_bytes + A.weight > A.quota then
  local oldest = redis.call('ZRANGE', K.retained, 0, 0, 'WITHSCORES')
  return {'tenant_quota', held_bytes .. ' ' .. (oldest[2] or now)}
end
redis.call('HSET', K.job, unpack(A.record))
local member = A.weight .. ' ' .. A.id
redis.call('HSET', K.job, 'retained_in', K.retained, 'retained_as', member)
redis.call('EXPIRE', K.job, A.ttl)
redis.call('XADD', K.intake, '*', unpack(A.entry))
waits(K.job, K.waiting, K.expiry, true)
redis.call('ZADD', K.retained, now + 1000 * A.ttl, member)
redis.call('INCRBY', K.retained_bytes, A.weight)
redis.call('EXPIRE', K.retained, A.ttl)
redis.call('EXPIRE', K.retained_bytes, A.ttl)
if K.idempotency then
  redis.call('SET', K.idempotency, A.idempotency_value, 'EX', A.idempotency_ttl)
  redis.call('HSET', K.job, 'idempotency_key', K.idempotency)
end
if A.callback_at then redis.call('ZADD', K.callbacks, A.callback_at, A.id) end  -- Webhooks
return {'ok', depth}
"""
)
