"""Fan-out of job announcements: one pub/sub connection per API process, many local watchers.

Pub/sub is at-most-once, so it only says "look again"; what a client receives is always read
from the job's stream. A watcher that misses a wake-up re-reads the stream after a short poll.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import Any

from app.core.keys import Keys

log = logging.getLogger(__name__)


class EventHub:
    def __init__(self, redis: Any, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._watchers: dict[str, set[asyncio.Event]] = defaultdict(set)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._listen(), name="event-hub")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            with suppress(asyncio.CancelledError):
                await self._task

    @asynccontextmanager
    async def watch(self, job_id: str) -> AsyncIterator[asyncio.Event]:
        event = asyncio.Event()
        self._watchers[job_id].add(event)
        try:
            yield event
        finally:
            watchers = self._watchers.get(job_id)
            if watchers is not None:
                watchers.discard(event)
                if not watchers:
                    del self._watchers[job_id]

    async def _listen(self) -> None:
        while True:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.psubscribe(self.keys.announce_pattern())
                self._wake_all()  # anything announced while we were away is read now
                async for message in pubsub.listen():
                    if message["type"] == "pmessage":
                        channel = message["channel"]
                        job_id = self.keys.job_id_from_announce(
                            channel.decode() if isinstance(channel, bytes) else channel
                        )
                        for watcher in self._watchers.get(job_id, ()):
                            watcher.set()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("event hub lost Redis; reconnecting", exc_info=True)
                await asyncio.sleep(0.5)
            finally:
                with suppress(Exception):
                    await pubsub.aclose()

    def _wake_all(self) -> None:
        for watchers in self._watchers.values():
            for watcher in watchers:
                watcher.set()
