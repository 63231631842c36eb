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
from app.core.scripts import Script

# K: retries (the schedule: id by due time), messages (id -> message), counts (tenant -> waiting).
# A: id, due, message, tenant, max (a tenant's waiting events). 0 when the tenant has `max` waiting.
SCHEDULE_LUA = """
if redis.call('HEXISTS', K.messages, A.id) == 1 then
  redis.call('HSET', K.messages, A.id, A.message)
  redis.call('ZADD', K.retries, A.due, A.id)
  return 1
end
local waiting = tonumber(redis.call('HGET', K.counts, A.tenant) or '0')
if waiting >= A.max then return 0 end
redis.call('HINCRBY', K.counts, A.tenant, 1)
redis.call('HSET', K.messages, A.id, A.message)
redis.call('ZADD', K.retries, A.due, A.id)
return 1
"""

# K: as SCHEDULE_LUA's. A.taken: per message {id, score (its due time when it was read), tenant};
# each still due at that score is forgotten. Returns how many.
REMOVE_LUA = """
local removed = 0
for _, t in ipairs(A.taken) do
  local score = redis.call('ZSCORE', K.retries, t.id)
  if score and tonumber(score) == tonumber(t.score) then
    redis.call('ZREM', K.retries, t.id)
    redis.call('HDEL', K.messages, t.id)
    if redis.call('HINCRBY', K.counts, t.tenant, -1) <= 0 then redis.call('HDEL', K.counts, t.tenant) end
    removed = removed + 1
  end
end
return removed
"""

# K.slots: a tenant's deliveries in progress (token by when it lapses). A: now, lapses (this slot's),
# max, token. 1 when the slot is taken.
ACQUIRE_LUA = """
redis.call('ZREMRANGEBYSCORE', K.slots, '-inf', A.now)
if redis.call('ZCARD', K.slots) >= A.max then return 0 end
redis.call('ZADD', K.slots, A.lapses, A.token)
redis.call('PEXPIREAT', K.slots, math.ceil(tonumber(A.lapses) * 1000))
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
        self._schedule = Script(redis, SCHEDULE_LUA)
        self._remove = Script(redis, REMOVE_LUA)

    def _keys(self) -> dict[str, str]:
        k = self.keys
        return {
            "retries": k.webhook_retries(),
            "messages": k.webhook_retry_messages(),
            "counts": k.webhook_retry_counts(),
        }

    def _schedule_args(self, message: dict[str, Any], due: float) -> dict[str, Any]:
        return {
            "id": message["webhook_id"],
            "due": repr(due),
            "message": json.dumps(message),
            "tenant": tenant_of(message),
            "max": self.max_per_tenant,
        }

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
        rows = []
        for message, token in taken:
            member, score = token.rsplit(" ", 1)
            rows.append({"id": member, "score": score, "tenant": tenant_of(message)})
        return int(self._remove(keys=self._keys(), args={"taken": rows})) if rows else 0

    def waiting(self, tenant: str) -> int:
        return int(self.redis.hget(self.keys.webhook_retry_counts(), tenant) or 0)


class TenantSlots:
    def __init__(self, redis: Any, keys: Keys, *, per_tenant: int, hold_s: float) -> None:
        self.redis = redis
        self.keys = keys
        self.per_tenant = per_tenant
        self.hold_s = hold_s  # a slot lapses this long after it was taken
        self._acquire = Script(redis, ACQUIRE_LUA)

    def acquire(self, tenant: str, *, now: float) -> str | None:
        """A slot's token, or None when the tenant has `per_tenant` deliveries in progress."""
        token = uuid.uuid4().hex
        args = {"now": repr(now), "lapses": repr(now + self.hold_s), "max": self.per_tenant, "token": token}
        return token if self._acquire(keys={"slots": self.keys.webhook_slots(tenant)}, args=args) else None

    def release(self, tenant: str, token: str) -> None:
        self.redis.zrem(self.keys.webhook_slots(tenant), token)

    def held(self, tenant: str, *, now: float) -> int:
        return int(self.redis.zcount(self.keys.webhook_slots(tenant), now, "+inf"))
