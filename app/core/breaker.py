"""A circuit breaker per model pipeline, shared in Redis by every API process.

    closed --(>= error_threshold of >= min_requests outcomes within interval_s failed)--> open
    open --(interval_s later, one submit claims the probe)--> half_open
    half_open --(the next outcome recorded: a success)--> closed
    half_open --(the next outcome recorded: a failure)--> open (for another interval_s)

Who writes what:
- stage workers count outcomes with `record` (sync redis-py, appended to their own pipeline): how
  many jobs of a model ended well or failed, in one-second buckets that expire. While the breaker
  is half-open, that same script lets the first outcome recorded decide it (a probe job is the
  only job admitted then, so that outcome is the probe's, or that of a job that was already in
  the pipeline when the breaker opened: either way it says whether the pipeline works now);
- the API reads a `Snapshot` at submit and asks `decide` (pure, clock passed in) what to do; it
  opens the breaker and claims the probe with small atomic scripts, so that two API processes
  never both probe and a stale read never reopens a breaker that has just closed.

A missing breaker hash reads as closed, so a model that never failed costs no key but its buckets.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from app.core.jobs import text_of
from app.core.keys import Keys
from app.core.scripts import Script

BUCKET_S = 1  # outcomes are counted per second; the window sums the last interval's buckets
OUTCOME_TTL_S = 600  # a bucket outlives the interval (Policy.interval_s) many times over
STATE_TTL_S = 86_400  # an open breaker nobody touches for a day is forgotten (reads as closed)


class State(enum.StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True)
class Policy:
    """The thresholds `decide` applies: the breaker opens when at least `min_requests` jobs ended
    within `interval_s` and `error_threshold` of them failed; one probe job after the interval. The
    API's are these defaults, held by `AdmissionSettings.breaker` (`Settings.admission`)."""

    error_threshold: float = 0.3
    min_requests: int = 100  # fewer: a few failures of a quiet model are noise
    interval_s: float = 30.0  # one-second buckets, read per submit


@dataclass(frozen=True)
class Snapshot:
    """What the breaker of one model looked like at `now`."""

    state: State = State.CLOSED
    opened_at: float | None = None  # open / half_open: when it (last) opened
    probe_until: float | None = None  # half_open: the probe claim holds until then
    since: float | None = None  # closed: outcomes before this belong to the previous episode
    buckets: Mapping[int, tuple[int, int]] = field(default_factory=dict)  # second -> (ok, failed)

    def counted(self, now: float, interval_s: float) -> tuple[int, int]:
        """(succeeded, failed) within the last interval, and since the breaker last closed."""
        start = max(now - interval_s, self.since if self.since is not None else -math.inf)
        first = math.floor(start / BUCKET_S) * BUCKET_S  # the bucket `start` falls in counts whole
        ok = sum(o for s, (o, _) in self.buckets.items() if first <= s <= now)
        failed = sum(f for s, (_, f) in self.buckets.items() if first <= s <= now)
        return ok, failed

    def completion_rate(self, now: float, interval_s: float) -> float | None:
        """Jobs ended (succeeded or failed) per second over the last interval: their count divided by
        the time since the first of them ended (at least one bucket), so an idle stretch before the
        work began does not dilute it. None when no job ended within the interval."""
        seen = {s: o + f for s, (o, f) in self.buckets.items() if now - interval_s - BUCKET_S < s <= now}
        seen = {s: n for s, n in seen.items() if n > 0}
        if not seen:
            return None
        span = max(float(BUCKET_S), now - min(seen))
        return sum(seen.values()) / span


class Action(enum.StrEnum):
    ADMIT = "admit"
    REFUSE = "refuse"
    TRIP = "trip"  # open the breaker (and refuse)
    PROBE = "probe"  # admit this one job as the half-open probe, if the claim succeeds


@dataclass(frozen=True)
class Verdict:
    action: Action
    retry_after_s: float = 0.0
    reason: str = ""


def decide(snap: Snapshot, policy: Policy, now: float) -> Verdict:
    """What a submit does about the breaker (pure: the snapshot and the clock are passed in)."""
    if snap.state == State.CLOSED:
        ok, failed = snap.counted(now, policy.interval_s)
        total = ok + failed
        if total >= policy.min_requests and failed / total >= policy.error_threshold:
            reason = f"{failed} of the last {total} jobs failed within {policy.interval_s:g} s"
            return Verdict(Action.TRIP, policy.interval_s, reason)
        return Verdict(Action.ADMIT)
    if snap.state == State.OPEN:
        reopen = (snap.opened_at or now) + policy.interval_s
        if now < reopen:
            return Verdict(Action.REFUSE, reopen - now, "the pipeline is failing")
        return Verdict(Action.PROBE)
    if snap.probe_until is not None and now < snap.probe_until:
        return Verdict(Action.REFUSE, snap.probe_until - now, "a probe job is testing the pipeline")
    return Verdict(Action.PROBE)


# --- the workers' side --------------------------------------------------------------------------

# K: breaker (its hash), bucket (this second's outcomes). A: ok, failed (jobs that ended so), now,
# bucket_ttl, state_ttl.
RECORD_LUA = """
if A.ok > 0 then redis.call('HINCRBY', K.bucket, 'ok', A.ok) end
if A.failed > 0 then redis.call('HINCRBY', K.bucket, 'failed', A.failed) end
redis.call('EXPIRE', K.bucket, A.bucket_ttl)
if redis.call('HGET', K.breaker, 'state') == 'half_open' then
  if A.failed > 0 then
    redis.call('HSET', K.breaker, 'state', 'open', 'opened_at', A.now)
    redis.call('HDEL', K.breaker, 'probe_until')
  elseif A.ok > 0 then
    redis.call('HSET', K.breaker, 'state', 'closed', 'since', A.now)
    redis.call('HDEL', K.breaker, 'opened_at', 'probe_until')
  end
  redis.call('EXPIRE', K.breaker, A.state_ttl)
end
return 1
"""


def record(pipe: Any, keys: Keys, model: str, *, succeeded: int, failed: int, now: float) -> None:
    """Count jobs of `model` that ended (succeeded / failed) at `now`, on a sync redis-py pipeline.

    Called by the stage workers when jobs finish or fail; the caller executes the pipeline. While
    the breaker is half-open this outcome decides it (see the module docstring)."""
    if succeeded <= 0 and failed <= 0:
        return
    second = math.floor(now / BUCKET_S) * BUCKET_S
    Script(pipe, RECORD_LUA)(
        keys={"breaker": keys.breaker(model), "bucket": keys.outcomes(model, second)},
        args={
            "ok": succeeded,
            "failed": failed,
            "now": repr(now),
            "bucket_ttl": OUTCOME_TTL_S,
            "state_ttl": STATE_TTL_S,
        },
        client=pipe,
    )


def recorder(
    redis: Any, keys: Keys, model: str, clock: Callable[[], float] = time.time
) -> Callable[[int, int], None]:
    """`(succeeded, failed) -> None` for one model, each call one round trip (an `Outcomes`' `breaker`).
    Count what says whether the pipeline works: not cancelled or expired jobs."""

    def outcomes(succeeded: int, failed: int) -> None:
        pipe = redis.pipeline(transaction=False)
        record(pipe, keys, model, succeeded=succeeded, failed=failed, now=clock())
        pipe.execute()

    return outcomes


# --- the API's side ------------------------------------------------------------------------------

# K.breaker: its hash. A: now, state_ttl, since (the `since` the decision was read with; 0: none).
# Opens a closed breaker (a missing hash is closed) unless it closed again since that read.
TRIP_LUA = """
local s = redis.call('HMGET', K.breaker, 'state', 'since')
if s[1] and s[1] ~= 'closed' then return 0 end
if tonumber(s[2] or '0') ~= tonumber(A.since) then return 0 end
redis.call('HSET', K.breaker, 'state', 'open', 'opened_at', A.now)
redis.call('HDEL', K.breaker, 'since', 'probe_until')
redis.call('EXPIRE', K.breaker, A.state_ttl)
return 1
"""

# K.breaker: its hash. A: now, interval, claim_ttl (the probe claim's), state_ttl.
# Claims the probe: an open breaker whose interval has passed, or a half-open one whose last claim
# lapsed (its probe never reported), becomes half-open with this claim. Returns 1 when claimed.
PROBE_LUA = """
local s = redis.call('HMGET', K.breaker, 'state', 'opened_at', 'probe_until')
local now = tonumber(A.now)
local due = (s[1] == 'open' and tonumber(s[2] or 0) + A.interval <= now)
  or (s[1] == 'half_open' and tonumber(s[3] or 0) <= now)
if not due then return 0 end
redis.call('HSET', K.breaker, 'state', 'half_open', 'probe_until', now + A.claim_ttl)
redis.call('EXPIRE', K.breaker, A.state_ttl)
return 1
"""

# K.breaker: its hash. A claimed probe that was not submitted after all frees the claim.
RELEASE_LUA = """
if redis.call('HGET', K.breaker, 'state') == 'half_open' then
  redis.call('HSET', K.breaker, 'probe_until', '0')
end
return 1
"""


@dataclass(frozen=True)
class Reader:
    """`replies` commands appended to a caller's pipeline, and how to read their replies."""

    replies: int
    parse: Callable[[Sequence[Any]], Snapshot]


class Breaker:
    """The API's view of the breakers (redis.asyncio); one per process, shared by its requests."""

    def __init__(self, redis: Any, keys: Keys, policy: Policy) -> None:
        self.redis = redis
        self.keys = keys
        self.policy = policy
        self._trip = Script(redis, TRIP_LUA)
        self._probe = Script(redis, PROBE_LUA)
        self._release = Script(redis, RELEASE_LUA)

    def read(self, pipe: Any, model: str, now: float) -> Reader:
        """Append the reads of a snapshot to `pipe`: the state hash and the last interval's buckets."""
        newest = math.floor(now / BUCKET_S) * BUCKET_S
        seconds = list(range(newest - math.ceil(self.policy.interval_s) - BUCKET_S, newest + 1, BUCKET_S))
        pipe.hgetall(self.keys.breaker(model))
        for second in seconds:
            pipe.hmget(self.keys.outcomes(model, second), ["ok", "failed"])

        def parse(replies: Sequence[Any]) -> Snapshot:
            state, *counts = replies
            fields = {text_of(k): text_of(v) for k, v in state.items()}
            buckets = {
                s: (int(ok or 0), int(failed or 0))
                for s, (ok, failed) in zip(seconds, counts, strict=True)
                if ok or failed
            }
            return Snapshot(
                state=State(fields.get("state", State.CLOSED)),
                opened_at=_float(fields.get("opened_at")),
                probe_until=_float(fields.get("probe_until")),
                since=_float(fields.get("since")),
                buckets=buckets,
            )

        return Reader(1 + len(seconds), parse)

    async def snapshot(self, model: str, now: float) -> Snapshot:
        """One round trip: see `read`."""
        pipe = self.redis.pipeline(transaction=False)
        reader = self.read(pipe, model, now)
        return reader.parse(await pipe.execute())

    async def trip(self, model: str, snap: Snapshot, now: float) -> bool:
        since = repr(snap.since) if snap.since is not None else "0"
        args = {"now": repr(now), "state_ttl": STATE_TTL_S, "since": since}
        return bool(await self._trip(keys={"breaker": self.keys.breaker(model)}, args=args))

    async def claim_probe(self, model: str, now: float) -> bool:
        interval = self.policy.interval_s
        args = {"now": repr(now), "interval": interval, "claim_ttl": interval, "state_ttl": STATE_TTL_S}
        return bool(await self._probe(keys={"breaker": self.keys.breaker(model)}, args=args))

    async def release_probe(self, model: str) -> None:
        await self._release(keys={"breaker": self.keys.breaker(model)})


def _float(value: str | None) -> float | None:
    return float(value) if value else None
