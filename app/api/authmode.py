"""How the API processes of a stack serve, kept in Redis for the `conveyor keys` commands.

Each API process records its auth mode (`CONVEYOR_AUTH`: `keys` or `none`) at start and every
RECORD_EVERY_S while it runs (`start_recording`, `stop_recording`: the app's lifespan), and takes its
record back when it stops. `conveyor keys create` reads the modes recorded in the last RECORD_TTL_S
(`served_modes`): a key stored for a stack whose API serves open (`make run`'s `CONVEYOR_AUTH=none`)
is checked by nobody, and the command says so. This module is the only writer of `Keys.api_auth`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from typing import Any

from redis.exceptions import RedisError

from app.core.keys import Keys

log = logging.getLogger(__name__)

RECORD_EVERY_S = 5.0
# Three records: a missed one or two (a slow Redis) does not drop the mark; a process killed without
# taking its record back is forgotten this long after its last record.
RECORD_TTL_S = 15


def member(mode: str) -> str:
    """This process's entry: `{mode} {host}:{pid}`."""
    return f"{mode} {socket.gethostname()}:{os.getpid()}"


async def record(redis: Any, keys: Keys, mode: str, *, now: float | None = None) -> None:
    """Record (or refresh) that this process serves with `mode`, and drop entries past RECORD_TTL_S."""
    now = time.time() if now is None else now
    async with redis.pipeline(transaction=True) as pipe:
        pipe.zadd(keys.api_auth(), {member(mode): now})
        pipe.zremrangebyscore(keys.api_auth(), "-inf", now - RECORD_TTL_S)
        pipe.expire(keys.api_auth(), RECORD_TTL_S)
        await pipe.execute()


async def start_recording(redis: Any, keys: Keys, mode: str) -> asyncio.Task[None]:
    """Called by the app's lifespan (app/api/app.py) before the API answers: the first record, then
    the task that keeps it fresh (`stop_recording` ends it)."""
    await _record_once(redis, keys, mode)
    return asyncio.create_task(_keep_recording(redis, keys, mode))


async def stop_recording(task: asyncio.Task[None], redis: Any, keys: Keys, mode: str) -> None:
    """Called by the lifespan as the API stops: end the task and take this process's record back."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    try:
        await redis.zrem(keys.api_auth(), member(mode))
    except RedisError:
        pass  # it lapses after RECORD_TTL_S


async def _keep_recording(redis: Any, keys: Keys, mode: str) -> None:
    """Record every RECORD_EVERY_S until cancelled; a Redis outage skips records, never ends the loop."""
    while True:
        await asyncio.sleep(RECORD_EVERY_S)
        await _record_once(redis, keys, mode)


async def _record_once(redis: Any, keys: Keys, mode: str) -> None:
    try:
        await record(redis, keys, mode)
    except RedisError as exc:
        log.debug("auth mode not recorded: %s", exc)


def served_modes(client: Any, keys: Keys, *, now: float | None = None) -> set[str]:
    """The auth modes of the API processes that recorded theirs in the last RECORD_TTL_S (a sync
    client: the CLI's). Empty: no API on this Redis and namespace is running."""
    now = time.time() if now is None else now
    entries = client.zrangebyscore(keys.api_auth(), now - RECORD_TTL_S, "+inf")
    return {(e.decode() if isinstance(e, bytes) else e).split(" ", 1)[0] for e in entries}
