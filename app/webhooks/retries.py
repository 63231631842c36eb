"""Where webhook deliveries wait and how many of one tenant's run: both in Redis, shared by every process.

- `RetryQueue`: an event's next attempt, due at a time. The callbacks worker schedules it after a
  failed attempt (or when its tenant has no free slot); the dispatcher polls the due ones and sends
  them to the callbacks queue. A retry is a member of a sorted set (`webhooks:retries`, scored by due
  time) and its message a field of a hash, so it survives any process's restart, and no worker holds
  it in memory (an ETA task would: a restart re-delivers it, and thousands of them sit in a
  worker's heap). One retry per webhook id (scheduling one already waiting replaces its message and
  due time); at most TENANT_MAX_RETRIES of one tenant's.
- `TenantSlots`: at most `per_tenant` deliveries of one tenant in progress (TENANT_CONCURRENCY of
  app/webhooks/delivery.py). A slot is a member of the tenant's sorted set, scored by when it lapses
  (the attempt's deadline and a margin), so a worker killed mid-attempt frees it then.

The dispatcher sends a due retry before removing it (`RetryQueue.remove` only takes a member still at
the score it read): a crash in between sends it twice, and the second copy finds the event settled.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from app.core.keys import Keys

SCHEDULE_LUA = """
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
  redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
  return 1
end
local waiting = tonumber(redis.call('HGET', KEYS[3], ARGV[4]) or '0')
if waiting >= tonumber(ARGV[5]) then return 0 end
redis.call('HINCRBY', KEYS[3], ARGV[4], 1)
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
return 1
"""

REMOVE_LUA = """
local removed = 0
for i = 1, #ARGV, 3 do
  local score = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if score and tonumber(score) == tonumber(ARGV[i + 1]) then
    redis.call('ZREM', KEYS[1], ARGV[i])
    redis.call('HDEL', KEYS[2], ARGV[i])
    if redis.call('HINCRBY', KEYS[3], ARGV[i + 2], -1) <= 0 then redis.call('HDEL', KEYS[3], ARGV[i + 2]) end
    removed = removed + 1
  end
end
return removed
"""

ACQUIRE_LUA = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[3]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[4])
redis.call('PEXPIREAT', KEYS[1], math.ceil(tonumber(ARGV[2]) * 1000))
return 1
"""

NO_TENANT = "anonymous"  # jobs submitted without a tenant share one bucket
# Events of one tenant waiting for a retry; past it a failed event is given up, so one tenant's dead
# receiver cannot fill Redis with retries.
TENANT_MAX_RETRIES = 10_000


def tenant_of(message: dict[str, Any]) -> str:
    return str(message.get("tenant") or NO_TENANT)


class RetryQueue:
    def __init__(self, redis: Any, keys: Keys, *, max_per_tenant: int | None = None) -> None:
        self.redis = redis
        self.keys = keys
        self.max_per_tenant = TENANT_MAX_RETRIES if max_per_tenant is None else max_per_tenant
        self._schedule = redis.register_script(SCHEDULE_LUA)
        self._remove = redis.register_script(REMOVE_LUA)

    def _keys(self) -> list[str]:
        k = self.keys
        return [k.webhook_retries(), k.webhook_retry_messages(), k.webhook_retry_counts()]

    def _schedule_args(self, message: dict[str, Any], due: float) -> list[Any]:
        return [
            message["webhook_id"],
            repr(due),
            json.dumps(message),
            tenant_of(message),
            self.max_per_tenant,
        ]

    def schedule(self, message: dict[str, Any], *, due: float) -> bool:
        """Queue `message` (its `attempt` says which) for `due`; False when its tenant already has
        `max_per_tenant` events waiting (the caller gives this one up)."""
        return bool(self._schedule(keys=self._keys(), args=self._schedule_args(message, due)))

    async def schedule_async(self, message: dict[str, Any], *, due: float) -> bool:
        """`schedule` over a redis.asyncio client (the API's)."""
        return bool(await self._schedule(keys=self._keys(), args=self._schedule_args(message, due)))

    def due(self, now: float, limit: int) -> list[tuple[dict[str, Any], str]]:
        """Up to `limit` messages due by `now`, oldest first, each with the token `remove` takes."""
        members = self.redis.zrangebyscore(
            self.keys.webhook_retries(), "-inf", now, 0, limit, withscores=True
        )
        if not members:
            return []
        ids = [m for m, _ in members]
        raws = self.redis.hmget(self.keys.webhook_retry_messages(), ids)
        out = []
        for (member, score), raw in zip(members, raws, strict=True):
            if raw is not None:
                token = (member.decode() if isinstance(member, bytes) else str(member)) + " " + repr(score)
                out.append((json.loads(raw), token))
        return out

    def remove(self, taken: list[tuple[dict[str, Any], str]]) -> int:
        """Forget messages `due` returned and the caller has sent (unless rescheduled meanwhile)."""
        args: list[str] = []
        for message, token in taken:
            member, score = token.rsplit(" ", 1)
            args += [member, score, tenant_of(message)]
        return int(self._remove(keys=self._keys(), args=args)) if args else 0

    def waiting(self, tenant: str) -> int:
        return int(self.redis.hget(self.keys.webhook_retry_counts(), tenant) or 0)


class TenantSlots:
    def __init__(self, redis: Any, keys: Keys, *, per_tenant: int, hold_s: float) -> None:
        self.redis = redis
        self.keys = keys
        self.per_tenant = per_tenant
        self.hold_s = hold_s  # a slot lapses this long after it was taken
        self._acquire = redis.register_script(ACQUIRE_LUA)

    def acquire(self, tenant: str, *, now: float) -> str | None:
        """A slot's token, or None when the tenant has `per_tenant` deliveries in progress."""
        token = uuid.uuid4().hex
        args = [repr(now), repr(now + self.hold_s), self.per_tenant, token]
        return token if self._acquire(keys=[self.keys.webhook_slots(tenant)], args=args) else None

    def release(self, tenant: str, token: str) -> None:
        self.redis.zrem(self.keys.webhook_slots(tenant), token)

    def held(self, tenant: str, *, now: float) -> int:
        return int(self.redis.zcount(self.keys.webhook_slots(tenant), now, "+inf"))
