"""Synchronous durability of submits (`CONVEYOR_SUBMIT_DURABILITY`).

`memory` (the default): a submit is answered 202 once Redis holds the job. Redis appends it to its
AOF at once and fsyncs the file every second (`appendfsync everysec`), so a crash of the Redis
host (not of Redis alone: the kernel still writes the page cache out) can lose the jobs accepted
in the last second, 202 and all.

`fsync`: a submit is answered 202 only once the job is on disk. Two ways, chosen at the API's start
from what the server offers:

- `always`: the server fsyncs its AOF before it answers any write (`appendonly yes`, `appendfsync
  always`; `conveyor up` starts the embedded Redis so in this mode). Every write pays an fsync.
- `waitaof`: Redis 7.2 and later: after the job's write the API waits with `WAITAOF 1 0 <timeout>`
  until the local AOF holds it; other writes keep `everysec`. A timeout answers 503
  `store_not_durable` (the job may still be written: a retry with the same Idempotency-Key is safe).

A Redis offering neither (older than 7.2 with `everysec`, or `CONFIG` disabled; any version with
`appendonly no`) stops the API at start with a message naming the setting: asking for durability
must never silently not get it. While the API runs, `FsyncWatch` reads the server's answer again
every RECHECK_S: a Redis reconfigured (`CONFIG SET appendonly no`) or replaced by one that cannot
give it refuses submits with 503 `store_not_durable` (and /readyz is not ready) until it can again.
The cost was measured by `bench/durability.py` at commit 57abc94 (bench/results/durability.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from redis.exceptions import ResponseError

from app.core.errors import Refused

WAITAOF_SINCE = (7, 2)
# How long one reading of the server's durability is trusted: a Redis reconfigured or replaced is
# seen this long after at most, for the cost of two reads per API process every RECHECK_S.
RECHECK_S = 2.0


class DurabilityUnavailable(RuntimeError):
    """CONVEYOR_SUBMIT_DURABILITY=fsync against a Redis that cannot give it."""


class NotDurable(Refused):
    """The job's write did not reach the AOF on disk within the wait (WAITAOF)."""

    code = "store_not_durable"
    status = 503


def version_of(info: dict[str, Any]) -> tuple[int, ...]:
    return tuple(int(part) for part in str(info.get("redis_version", "0")).split(".")[:3] if part.isdigit())


async def fsync_mode(redis: Any) -> str:
    """How this Redis makes a submit durable: `waitaof` or `always`; raises DurabilityUnavailable."""
    version = version_of(await redis.info("server"))
    shown = ".".join(map(str, version))
    try:
        config = await redis.config_get("appendonly")
        config |= await redis.config_get("appendfsync")
    except ResponseError as exc:
        if version >= WAITAOF_SINCE:
            return "waitaof"  # CONFIG disabled (a managed Redis): WAITAOF itself refuses without an AOF
        raise DurabilityUnavailable(
            f"CONVEYOR_SUBMIT_DURABILITY=fsync: Redis {shown} has no WAITAOF (7.2+) and its configuration "
            f"cannot be read ({exc}); run Redis 7.2 or later, or with appendonly yes and appendfsync always"
        ) from exc
    config = {_text(k): _text(v) for k, v in config.items()}
    if version >= WAITAOF_SINCE:
        if config.get("appendonly") == "yes":
            return "waitaof"
        raise DurabilityUnavailable(
            f"CONVEYOR_SUBMIT_DURABILITY=fsync: Redis {shown} runs with appendonly "
            f"{config.get('appendonly')}: there is no AOF to wait for; set appendonly yes"
        )
    if config.get("appendonly") == "yes" and config.get("appendfsync") == "always":
        return "always"
    raise DurabilityUnavailable(
        f"CONVEYOR_SUBMIT_DURABILITY=fsync: Redis {shown} has no WAITAOF (7.2+) and runs with "
        f"appendonly {config.get('appendonly')}, appendfsync {config.get('appendfsync')}; run Redis 7.2 "
        "or later, or set appendonly yes and appendfsync always (conveyor up does for its embedded Redis)"
    )


class FsyncWatch:
    """CONVEYOR_SUBMIT_DURABILITY=fsync while the API runs. Built at the API's start from the mode
    `fsync_mode` found; admission calls `mode()` before each job's write, /readyz `problem()`.
    The server is asked again at most every RECHECK_S (the clock is injected for tests)."""

    def __init__(self, redis: Any, mode: str, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.redis = redis
        self.clock = clock
        self._mode = mode
        self._problem: str | None = None
        self._read_at = clock()

    async def problem(self) -> str | None:
        """Why the server cannot make a submit durable now; None when it can."""
        if self.clock() - self._read_at >= RECHECK_S:
            self._read_at = self.clock()
            try:
                self._mode, self._problem = await fsync_mode(self.redis), None
            except DurabilityUnavailable as exc:
                self._problem = str(exc)
        return self._problem

    async def mode(self) -> str:
        """How a submit is made durable now (`wait_on_disk`'s mode); NotDurable while it cannot be."""
        problem = await self.problem()
        if problem is not None:
            raise NotDurable(
                f"the job store cannot keep a job on disk now, so none is accepted ({problem})",
                retry_after_s=RECHECK_S,
            )
        return self._mode


async def wait_on_disk(redis: Any, mode: str, timeout_ms: int) -> None:
    """After a job's write: return once it is on disk (nothing to wait for under `always`)."""
    if mode != "waitaof":
        return
    try:
        local, _replicas = await redis.execute_command("WAITAOF", 1, 0, timeout_ms)
    except ResponseError as exc:  # `appendonly no` since the last look: WAITAOF refuses
        raise NotDurable(
            f"the job was written but cannot be fsynced ({exc}); retry with the same Idempotency-Key",
            retry_after_s=RECHECK_S,
        ) from exc
    if int(local) < 1:
        raise NotDurable(
            f"the job was written but not fsynced to the AOF within {timeout_ms} ms; retry with the same "
            "Idempotency-Key",
            retry_after_s=1,
        )


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
