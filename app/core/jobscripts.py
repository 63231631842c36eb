"""The job store's Lua scripts (app/core/jobstore.py runs them; no other module may register them:
tests/unit/test_job_writes.py). The states a script may move a job from, and the names of statuses,
timestamps and final events, are filled in from the lifecycle's table (app/core/jobs.py), never
written by hand."""

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
# transition(key, o, waiting, expiry): `move` with its arguments from ARGV[o+1..] = target, n, n
# allowed predecessors, g, g guard field/value pairs, then field/value pairs to write.
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
local function transition(key, o, waiting, expiry)
  local n = tonumber(ARGV[o + 2])
  local g = tonumber(ARGV[o + 3 + n])
  local first = o + 4 + n + 2 * g
  local from, guard, fields = {}, {}, {}
  for i = o + 3, o + 2 + n do from[ARGV[i]] = true end
  for i = o + 4 + n, first - 1, 2 do guard[ARGV[i]] = ARGV[i + 1] end
  for j = first, #ARGV do table.insert(fields, ARGV[j]) end
  return move(key, ARGV[o + 1], from, guard, fields, waiting, expiry)
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
STEP_LUA = (
    WAITING_FUNCTION
    + TRANSITION_FUNCTION
    + ENDED_FUNCTION
    + _lua(
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
      move(job, $SUCCEEDED, streaming, {}, {$SUCCEEDED_AT, now, 'finish_reason', ARGV[a + 7]}, nil, nil)
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
    + TRANSITION_FUNCTION
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
  move(KEYS[2], $FAILED, recoverable, {}, {$FAILED_AT, ARGV[4], 'attempts', attempts, 'error', ARGV[8]},
       KEYS[6], KEYS[7])
  redis.call('XADD', KEYS[3], 'MAXLEN', ARGV[5], '*', 'event', $FAILED_EVENT, 'data', ARGV[8])
  ended(KEYS[2], KEYS[3], ARGV[6], '')
  redis.call('PUBLISH', ARGV[7], $FAILED_EVENT)
  return $FAILED
end
move(KEYS[2], $RECOVERING, recoverable, {}, {$RECOVERING_AT, ARGV[4], 'attempts', attempts}, KEYS[6], KEYS[7])
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
