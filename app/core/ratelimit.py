"""Per-tenant rate limits, shared by every API process: GCRA in one Lua script.

Three limits per tenant, checked and charged together at submit (all or nothing):

- requests: `rps` job-creating requests per second, `burst` of them at once (two seconds' worth,
  `default_burst`, unless a tenant's override gives its own);
- tokens: `tokens_per_min` generated tokens per minute, a minute's worth at once. A job is charged
  its `max_tokens` when it is submitted (what it may generate, not what it will: simple and never
  under-charged); a job that is then not queued (admission refused it) is refunded;
- embedding bytes: `embedding_bytes_per_min` bytes of embeddings input per minute, a minute's worth
  at once, a request counted padded (`intake.padded_bytes`: every text as long as its longest, the
  work a batch does for it; its texts wait in Redis for their job, so this bounds that too).

A request is charged on the limits it uses (a request always, tokens for a job, bytes for
embeddings); the others neither refuse it nor move.

GCRA (the generic cell rate algorithm) keeps one number per limit: the theoretical arrival time
`tat`, when the bucket would be full again. With `T` the interval per unit (1/rate) and `C` the
capacity, a charge of `n` units at `now` is admitted when

    max(tat, now) + n*T - now <= C*T

and moves `tat` there. From idle, C units pass at once; over any window of D seconds at most
C + rate*D do. The script reads Redis's clock (TIME) unless a test passes one, so API processes
with skewed clocks still share one limit. The tenant's hash expires once both buckets are full.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from app.core.config import RateLimiterSettings
from app.core.errors import InvalidRequest, MaxTokensExceeded, RateLimited
from app.core.keys import Keys
from app.core.scripts import Script

BURST_S = 2  # a tenant's burst, unless its override gives one: this many seconds of its request rate

# K.tenant: the tenant's hash. A.now: now in ms (absent: Redis's clock). A.buckets: per bucket
# b = 1 (requests), 2 (tokens), 3 (embedding bytes) its interval in ms per unit (0 = not charged),
# capacity (units at once) and cost (units; below 0 a refund, always applied).
# Returns {admitted 0/1, refusing bucket (0 none), retry in ms, then per bucket: remaining, full in
# ms}: integers, as Redis converts Lua numbers to integers anyway.
GCRA_LUA = """
local now = A.now
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
end
local fields = {'requests', 'tokens', 'bytes'}
local out = {1, 0, 0, -1, 0, -1, 0, -1, 0}
local tats = {}
for b, bucket in ipairs(A.buckets) do
  local interval = bucket.interval
  if interval > 0 then
    local capacity, cost = bucket.capacity, bucket.cost
    local tat = tonumber(redis.call('HGET', K.tenant, fields[b])) or now
    local base = math.max(tat, now)
    local new = math.max(base + cost * interval, now)
    local dvt = capacity * interval
    if cost > 0 and new - now > dvt then
      local wait = math.ceil(new - now - dvt)
      out[1] = 0
      if wait > out[3] then
        out[2] = b
        out[3] = wait
      end
      new = base
    end
    tats[b] = new
    out[2 + 2 * b] = math.floor((dvt - (new - now)) / interval)
    out[3 + 2 * b] = math.ceil(new - now)
  end
end
if out[1] == 1 then
  local full = 0
  for b = 1, 3 do
    if tats[b] then
      redis.call('HSET', K.tenant, fields[b], string.format('%.3f', tats[b]))
      full = math.max(full, tats[b] - now)
    end
  end
  if full > 0 then redis.call('PEXPIRE', K.tenant, math.ceil(full) + 1000) end
end
return out
"""

REQUESTS, TOKENS, EMBEDDING_BYTES = "requests", "tokens", "embedding_bytes"


@dataclass(frozen=True)
class Bucket:
    """One limit, resolved for a tenant: `capacity` units at once, one more every `interval_ms`."""

    name: str
    capacity: int
    interval_ms: float

    def describe(self) -> str:
        if self.name == REQUESTS:
            return f"{1000 / self.interval_ms:g} requests per second (burst {self.capacity})"
        if self.name == EMBEDDING_BYTES:
            return f"{self.capacity} bytes of embeddings input per minute"
        return f"{self.capacity} tokens per minute"


@dataclass(frozen=True)
class Policy:
    requests: Bucket | None  # None: no limit
    tokens: Bucket | None
    embedding_bytes: Bucket | None = None


def default_burst(rps: float) -> int:
    """Requests a tenant may send at once at `rps` a second, unless it is given a burst: BURST_S
    seconds' worth, rounded up, at least one (100 at the default 50/s)."""
    return max(1, math.ceil(BURST_S * rps))


def policy_for(settings: RateLimiterSettings, tenant: str) -> Policy:
    """The tenant's limits: its override in `rate_limits`, field by field, else the defaults; its
    burst, unless given, follows its rate (`default_burst`)."""
    override = settings.tenants.get(tenant)
    rps = settings.rps if override is None or override.rps is None else override.rps
    burst = default_burst(rps) if override is None or override.burst is None else override.burst
    per_min = settings.tokens_per_min
    if override is not None and override.tokens_per_min is not None:
        per_min = override.tokens_per_min
    nbytes = settings.embedding_bytes_per_min
    if override is not None and override.embedding_bytes_per_min is not None:
        nbytes = override.embedding_bytes_per_min
    return Policy(
        requests=Bucket(REQUESTS, burst, 1000.0 / rps) if rps > 0 else None,
        tokens=Bucket(TOKENS, per_min, 60_000.0 / per_min) if per_min > 0 else None,
        embedding_bytes=Bucket(EMBEDDING_BYTES, nbytes, 60_000.0 / nbytes) if nbytes > 0 else None,
    )


@dataclass(frozen=True)
class Quota:
    """Where a tenant stands on one limit after a charge: the IETF draft's RateLimit-* headers
    (Limit: the capacity; Remaining: units left now; Reset: seconds until the bucket is full)."""

    name: str
    limit: int
    remaining: int
    reset_s: int

    def headers(self) -> dict[str, str]:
        return {
            "RateLimit-Limit": str(self.limit),
            "RateLimit-Remaining": str(max(0, self.remaining)),
            "RateLimit-Reset": str(max(0, self.reset_s)),
        }


@dataclass(frozen=True)
class Outcome:
    admitted: bool
    refused_by: Bucket | None
    retry_after_s: float
    quotas: dict[str, Quota]

    def reported(self) -> Quota:
        """The quota the headers show: the refusing limit, else the one with the least left."""
        if self.refused_by is not None:
            return self.quotas[self.refused_by.name]
        return min(self.quotas.values(), key=lambda q: q.remaining / max(1, q.limit))


class RateLimiter:
    """The tenant limits over redis.asyncio; one per API process (JobService holds it). `settings`:
    `Settings.rate_limiter`."""

    def __init__(self, redis: Any, keys: Keys, settings: RateLimiterSettings) -> None:
        self.redis = redis
        self.keys = keys
        self.settings = settings
        self._gcra = Script(redis, GCRA_LUA)

    async def charge(
        self, tenant: str, *, requests: int, tokens: int, embedding_bytes: int = 0, now: float | None = None
    ) -> Outcome | None:
        """Charge the limits a request uses at once (those with a cost; negative costs refund); None
        when the tenant has no limit on them."""
        policy = policy_for(self.settings, tenant)
        costs = (requests, tokens, embedding_bytes)
        limits = (policy.requests, policy.tokens, policy.embedding_bytes)
        buckets = tuple(b if cost else None for b, cost in zip(limits, costs, strict=True))
        if not any(buckets):
            return None
        args: dict[str, Any] = {
            "buckets": [
                {"interval": b.interval_ms, "capacity": b.capacity, "cost": cost}
                if b
                else {"interval": 0, "capacity": 0, "cost": 0}
                for b, cost in zip(buckets, costs, strict=True)
            ]
        }
        if now is not None:
            args["now"] = now * 1000
        reply = [int(x) for x in await self._gcra(keys={"tenant": self.keys.rate_limit(tenant)}, args=args)]
        quotas = {
            b.name: Quota(b.name, b.capacity, reply[3 + 2 * i], math.ceil(reply[4 + 2 * i] / 1000))
            for i, b in enumerate(buckets)
            if b is not None
        }
        refused_by = buckets[reply[1] - 1] if reply[1] else None
        return Outcome(bool(reply[0]), refused_by, reply[2] / 1000, quotas)

    async def take(self, tenant: str, *, tokens: int, now: float | None = None) -> Quota | None:
        """Charge one job-creating request of up to `tokens` tokens; raise RateLimited (429) when
        either limit is spent, MaxTokensExceeded (422) when the job alone is over the token limit.
        Called by JobService before admission; `refund` when the job is then not queued."""
        per_job = policy_for(self.settings, tenant).tokens
        if per_job is not None and tokens > per_job.capacity:
            raise MaxTokensExceeded(
                f"max_tokens is {tokens}, over this tenant's limit of {per_job.capacity} tokens per minute",
                limit=per_job.capacity,
            )
        return self._admitted(tenant, await self.charge(tenant, requests=1, tokens=tokens, now=now))

    async def take_embedding(self, tenant: str, *, nbytes: int, now: float | None = None) -> Quota | None:
        """Charge one embeddings request counted as `nbytes` bytes (padded); raise RateLimited (429) when the
        request or byte limit is spent, InvalidRequest (422) when the request alone is over the byte
        limit (it could never pass)."""
        per_request = policy_for(self.settings, tenant).embedding_bytes
        if per_request is not None and nbytes > per_request.capacity:
            raise InvalidRequest(
                f"the input counts {nbytes} bytes (padded: every text as long as the longest), over this "
                f"tenant's limit of {per_request.describe()}",
                limit=per_request.capacity,
            )
        outcome = await self.charge(tenant, requests=1, tokens=0, embedding_bytes=nbytes, now=now)
        return self._admitted(tenant, outcome)

    def _admitted(self, tenant: str, outcome: Outcome | None) -> Quota | None:
        if outcome is None:
            return None
        if outcome.refused_by is not None:
            quota = outcome.reported()
            raise RateLimited(
                f"tenant {tenant!r} is over its limit of {outcome.refused_by.describe()}; "
                f"retry in {max(1, math.ceil(outcome.retry_after_s))} s",
                retry_after_s=outcome.retry_after_s,
                rate_headers=quota.headers(),
                limit=outcome.refused_by.name,
            )
        return outcome.reported()

    async def refund(self, tenant: str, *, tokens: int, now: float | None = None) -> None:
        """Give back the tokens of a job that was charged but not queued."""
        if tokens > 0:
            await self.charge(tenant, requests=0, tokens=-tokens, now=now)
