"""Files and batches of OpenAI's Batch API: the one writer of their records (`file:*`, `batch:*` and the
tenants' and open-batch indexes, app/core/keys.py), over redis.asyncio.

Who calls what:
- the API's routes (app/api/routes/batches.py): `put_file`, `file`, `content`, `delete_file`,
  `create`, `batch`, `page`, `move` (to cancelling);
- the feeder (app/api/batchfeed.py): `open_ids`, `start` (validated lines, in_progress), `fed`,
  `lines`, `collect`, `results`, `move` (failed, finalizing, and the end: completed, cancelled,
  expired) and `put_file` for the output and error files.

A batch's status moves only along `MOVES`, each move one script that checks the status it leaves and
stamps the time of the one it enters (`{status}_at`, OpenAI's field names); the final moves take the
batch out of the open set in the same script, and put a batch with a callback (`announce_url`) in the set of
batches to announce (the feeder hands each to the webhook retry queue, then takes it out). A file
counts against its tenant's byte quota from the script that stores it to the one that deletes it (or
until it expires).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from app.core.errors import BatchNotFound, FileNotFound, FileQuotaExceeded
from app.core.jobs import decode_record
from app.core.keys import Keys
from app.core.scripts import Script

FILE_ID = re.compile(r"file-[0-9a-f]{32}")
BATCH_ID = re.compile(r"batch_[0-9a-f]{32}")
WINDOWS = {"24h": 86_400}
FILE_MAX_LINES = 50_000  # lines (requests) of one batch's input file at most, as OpenAI allows
# How long files and batches (their records, lines and results) are kept: a week, time to run a
# batch through its 24 h window and fetch its output.
FILE_TTL_S = 7 * 86_400

VALIDATING, IN_PROGRESS, FINALIZING = "validating", "in_progress", "finalizing"
COMPLETED, FAILED, CANCELLING, CANCELLED, EXPIRED = (
    "completed",
    "failed",
    "cancelling",
    "cancelled",
    "expired",
)
FINAL = frozenset({COMPLETED, FAILED, CANCELLED, EXPIRED})
# status -> the statuses a batch may enter it from
MOVES: Mapping[str, frozenset[str]] = {
    IN_PROGRESS: frozenset({VALIDATING}),
    FAILED: frozenset({VALIDATING}),
    CANCELLING: frozenset({VALIDATING, IN_PROGRESS}),
    FINALIZING: frozenset({IN_PROGRESS}),
    COMPLETED: frozenset({FINALIZING}),
    CANCELLED: frozenset({CANCELLING}),
    EXPIRED: frozenset({IN_PROGRESS}),
}

# K: record, content, files (the tenant's). A: now (ms), ttl (s), quota (absent: not counted), size
# (bytes), id, content, record (the record's field/value list). Expired entries of the tenant's files
# are dropped first. Returns {1, size}, or {0, the bytes the tenant's files hold} past the quota.
PUT_FILE_LUA = """
if A.quota then
  local used = 0
  local all = redis.call('HGETALL', K.files)
  for i = 1, #all, 2 do
    local bytes, expiry = string.match(all[i + 1], '(%d+) (%d+)')
    if tonumber(expiry) <= A.now then
      redis.call('HDEL', K.files, all[i])
    else
      used = used + tonumber(bytes)
    end
  end
  if used + A.size > A.quota then return {0, used} end
  redis.call('HSET', K.files, A.id, A.size .. ' ' .. (A.now + A.ttl * 1000))
  redis.call('EXPIRE', K.files, A.ttl)
end
redis.call('SET', K.content, A.content, 'EX', A.ttl)
redis.call('HSET', K.record, unpack(A.record))
redis.call('EXPIRE', K.record, A.ttl)
return {1, A.size}
"""

# K: record, open (the open batches), announce (the batches to announce). A: id, field (the status
# field's name), to (the new status), stamp (its timestamp field), now, final, from (the statuses it
# may come from), fields (a field/value list). Returns 'ok', or the status it had ('' for none).
MOVE_LUA = """
local current = redis.call('HGET', K.record, A.field)
if not current then return '' end
local allowed = false
for _, status in ipairs(A.from) do if status == current then allowed = true end end
if not allowed then return current end
redis.call('HSET', K.record, A.field, A.to, A.stamp, A.now)
if #A.fields > 0 then redis.call('HSET', K.record, unpack(A.fields)) end
if A.final then
  redis.call('ZREM', K.open, A.id)
  if redis.call('HEXISTS', K.record, 'announce_url') == 1 then redis.call('SADD', K.announce, A.id) end
end
return 'ok'
"""

# K: results, record. A: index (the line's), outcome ('completed' or 'failed': the count it adds to),
# line, ttl (s). Counted once.
COLLECT_LUA = """
if redis.call('HSETNX', K.results, A.index, A.line) == 1 then
  redis.call('HINCRBY', K.record, A.outcome, 1)
  redis.call('EXPIRE', K.results, A.ttl)
  return 1
end
return 0
"""


@dataclass(frozen=True)
class StoredFile:
    id: str
    tenant: str
    filename: str
    purpose: str
    bytes: int
    created_at: int
    expires_at: int


def _file(record: Mapping[str, str]) -> StoredFile:
    return StoredFile(
        id=record["id"],
        tenant=record["tenant"],
        filename=record["filename"],
        purpose=record["purpose"],
        bytes=int(record["bytes"]),
        created_at=int(record["created_at"]),
        expires_at=int(record["expires_at"]),
    )


def line_job_id(batch_id: str, index: int) -> str:
    """The job id of a batch's line: the same for the same line every time it is fed, so a feeder
    that dies between writing a job and recording it writes no second one."""
    return uuid.uuid5(uuid.NAMESPACE_URL, f"conveyor-batch:{batch_id}/{index}").hex


def output_file_id(batch_id: str, kind: str) -> str:
    """A batch's output (`output`) or error (`error`) file: the same id however often it is finalized."""
    return "file-" + uuid.uuid5(uuid.NAMESPACE_URL, f"conveyor-batch:{batch_id}/{kind}").hex


class BatchStore:
    """One per API process (beside JobService)."""

    def __init__(self, redis: Any, keys: Keys, *, ttl_s: int = FILE_TTL_S) -> None:
        self.redis = redis
        self.keys = keys
        self.ttl_s = ttl_s
        self._put = Script(redis, PUT_FILE_LUA)
        self._move = Script(redis, MOVE_LUA)
        self._collect = Script(redis, COLLECT_LUA)

    # --- files ----------------------------------------------------------------------------------------

    async def put_file(
        self,
        *,
        tenant: str,
        filename: str,
        purpose: str,
        content: bytes,
        quota: int | None,
        file_id: str | None = None,
    ) -> StoredFile:
        """Store a file owned by `tenant`; with `quota`, counted against it (429 file_quota_exceeded
        past it). `file_id`: a batch's output file's own id (stored again, the same, if finalized twice)."""
        now = time.time()
        stored = StoredFile(
            id=file_id or f"file-{uuid.uuid4().hex}",
            tenant=tenant,
            filename=filename,
            purpose=purpose,
            bytes=len(content),
            created_at=int(now),
            expires_at=int(now) + self.ttl_s,
        )
        keys = {
            "record": self.keys.file(stored.id),
            "content": self.keys.file_content(stored.id),
            "files": self.keys.tenant_files(tenant),
        }
        args: dict[str, Any] = {
            "now": int(now * 1000),
            "ttl": self.ttl_s,
            "size": len(content),
            "id": stored.id,
            "content": content.decode("utf-8"),
            "record": [str(x) for pair in vars(stored).items() for x in pair],
        }
        if quota is not None:
            args["quota"] = quota
        written, used = await self._put(keys=keys, args=args)
        if not int(written):
            raise FileQuotaExceeded(
                f"your stored files hold {int(used)} bytes; this one ({len(content)} bytes) would pass the "
                f"quota of {quota} bytes. Delete files (DELETE /v1/files/{{id}}) or wait for them to expire",
                limit=quota,
                used=int(used),
            )
        return stored

    async def file(self, file_id: str, *, tenant: str) -> StoredFile:
        """A file of `tenant`'s; another tenant's is 404 file_not_found, as an unknown one."""
        raw = await self.redis.hgetall(self.keys.file(file_id)) if FILE_ID.fullmatch(file_id) else None
        record = decode_record(raw) if raw else None
        if record is None or record.get("tenant") != tenant:
            raise FileNotFound(f"file {file_id[:64]!r} does not exist (or has expired)", file_id=file_id[:64])
        return _file(record)

    async def content(self, file_id: str, *, tenant: str) -> bytes:
        await self.file(file_id, tenant=tenant)
        content = await self.redis.get(self.keys.file_content(file_id))
        if content is None:
            raise FileNotFound(f"file {file_id!r} does not exist (or has expired)", file_id=file_id)
        return bytes(content)

    async def delete_file(self, file_id: str, *, tenant: str) -> None:
        await self.file(file_id, tenant=tenant)
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(self.keys.file(file_id), self.keys.file_content(file_id))
        pipe.hdel(self.keys.tenant_files(tenant), file_id)
        await pipe.execute()

    # --- batches --------------------------------------------------------------------------------------

    async def create(
        self,
        *,
        tenant: str,
        input_file_id: str,
        endpoint: str,
        window: str,
        metadata: Mapping[str, str] | None,
        callback_url: str | None = None,
    ) -> dict[str, str]:
        """A new batch, `validating`, in the open set (the feeder validates its file next)."""
        exact = time.time()  # the indexes' order: two batches of one second are still in order
        now = int(exact)
        batch_id = f"batch_{uuid.uuid4().hex}"
        record = {
            "id": batch_id,
            "tenant": tenant,
            "endpoint": endpoint,
            "input_file_id": input_file_id,
            "completion_window": window,
            "status": VALIDATING,
            "created_at": str(now),
            "expires_at": str(now + WINDOWS[window]),
            "metadata": json.dumps(dict(metadata) if metadata else None),
            "total": "0",
            "completed": "0",
            "failed": "0",
            "fed": "0",
        }
        if callback_url is not None:
            record["announce_url"] = callback_url  # its field: a job's name would read as one
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(self.keys.batch(batch_id), mapping=record)
        pipe.expire(self.keys.batch(batch_id), self.ttl_s)
        pipe.zadd(self.keys.tenant_batches(tenant), {batch_id: exact})
        pipe.expire(self.keys.tenant_batches(tenant), self.ttl_s)
        pipe.zadd(self.keys.open_batches(), {batch_id: exact})
        pipe.expire(self.keys.open_batches(), self.ttl_s)
        await pipe.execute()
        return record

    async def batch(self, batch_id: str, *, tenant: str | None) -> dict[str, str]:
        """A batch's record; another tenant's is 404 batch_not_found (`tenant` None: no check)."""
        raw = await self.redis.hgetall(self.keys.batch(batch_id)) if BATCH_ID.fullmatch(batch_id) else None
        record = decode_record(raw) if raw else None
        if record is None or (tenant is not None and record.get("tenant") != tenant):
            raise BatchNotFound(
                f"batch {batch_id[:64]!r} does not exist (or has expired)", batch_id=batch_id[:64]
            )
        return record

    async def page(self, tenant: str, *, after: str | None, limit: int) -> tuple[list[dict[str, str]], bool]:
        """The tenant's batches, newest first, after the batch `after`; and whether more follow."""
        ids = [
            i.decode() if isinstance(i, bytes) else i
            for i in await self.redis.zrevrange(self.keys.tenant_batches(tenant), 0, -1)
        ]
        start = ids.index(after) + 1 if after in ids else 0
        records = []
        for batch_id in ids[start:]:
            raw = await self.redis.hgetall(self.keys.batch(batch_id))
            if raw:
                records.append(decode_record(raw))
            if len(records) > limit:
                break
        return records[:limit], len(records) > limit

    async def move(self, batch_id: str, to: str, **fields: str) -> tuple[bool, str]:
        """Move the batch to `to` if `MOVES` allows it from its status: (moved, the status it had)."""
        args = {
            "id": batch_id,
            "field": "status",
            "to": to,
            "stamp": f"{to}_at",
            "now": str(int(time.time())),
            "final": to in FINAL,
            "from": sorted(MOVES[to]),
            "fields": [x for pair in fields.items() for x in pair],
        }
        keys = {
            "record": self.keys.batch(batch_id),
            "open": self.keys.open_batches(),
            "announce": self.keys.batches_to_announce(),
        }
        outcome = await self._move(keys=keys, args=args)
        text = outcome.decode() if isinstance(outcome, bytes) else str(outcome)
        return text == "ok", "" if text == "ok" else text

    async def start(self, batch_id: str, lines: Sequence[str]) -> bool:
        """Store a validated batch's lines and move it `in_progress`, together; False if it is no
        longer `validating` (cancelled meanwhile, or another feeder did it)."""
        key = self.keys.batch(batch_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            await pipe.watch(key)
            if (await pipe.hget(key, "status") or b"").decode() != VALIDATING:
                return False
            pipe.multi()
            pipe.delete(self.keys.batch_lines(batch_id))
            for at in range(0, len(lines), 1000):
                pipe.rpush(self.keys.batch_lines(batch_id), *lines[at : at + 1000])
            pipe.expire(self.keys.batch_lines(batch_id), self.ttl_s)
            now = str(int(time.time()))
            pipe.hset(key, mapping={"status": IN_PROGRESS, "in_progress_at": now, "total": str(len(lines))})
            await pipe.execute()
        return True

    async def fed(self, batch_id: str, count: int) -> None:
        """Record that the batch's first `count` lines are jobs (the feeder's cursor)."""
        await self.redis.hset(self.keys.batch(batch_id), "fed", str(count))

    async def lines(self, batch_id: str, start: int, stop: int) -> list[str]:
        """Lines `start` to `stop` (excluded) of a started batch."""
        raw = await self.redis.lrange(self.keys.batch_lines(batch_id), start, stop - 1)
        return [r.decode() if isinstance(r, bytes) else r for r in raw]

    async def collect(self, batch_id: str, index: int, line: str, *, ok: bool) -> None:
        """Keep line `index`'s output (`ok`) or error line and count it, once however often it is given."""
        keys = {"results": self.keys.batch_results(batch_id), "record": self.keys.batch(batch_id)}
        args = {"index": index, "outcome": COMPLETED if ok else FAILED, "line": ("o" if ok else "e") + line}
        await self._collect(keys=keys, args=args | {"ttl": self.ttl_s})

    async def collected(self, batch_id: str) -> set[int]:
        return {int(i) for i in await self.redis.hkeys(self.keys.batch_results(batch_id))}

    async def results(self, batch_id: str) -> list[tuple[int, bool, str]]:
        """Every collected line: (index, ok, the line), in input order."""
        raw = await self.redis.hgetall(self.keys.batch_results(batch_id))
        items = decode_record(raw) if raw else {}
        return sorted((int(i), v[0] == "o", v[1:]) for i, v in items.items())

    async def open_ids(self) -> list[str]:
        """The batches not yet ended, oldest first."""
        raw = await self.redis.zrange(self.keys.open_batches(), 0, -1)
        return [r.decode() if isinstance(r, bytes) else r for r in raw]

    async def to_announce(self) -> list[str]:
        """The ended batches with a callback whose end is not yet handed to the webhook retry queue."""
        raw = await self.redis.smembers(self.keys.batches_to_announce())
        return sorted(r.decode() if isinstance(r, bytes) else r for r in raw)

    async def announced(self, batch_id: str) -> None:
        await self.redis.srem(self.keys.batches_to_announce(), batch_id)

    async def forget(self, batch_id: str) -> None:
        """Drop a batch whose record has expired from the open set."""
        await self.redis.zrem(self.keys.open_batches(), batch_id)
