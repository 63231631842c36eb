"""Fan-out of job announcements: one pub/sub connection per API process, many local watchers.

Pub/sub is at-most-once, so it only says "look again"; what a client receives is always read
from the job's stream. A watcher that misses a wake-up re-reads the stream after a short poll.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import Any

from app.core import aio
from app.core.keys import Keys

log = logging.getLogger(__name__)

LISTEN_TIMEOUT_S = 1.0
RESUBSCRIBE_S = 0.5  # while Redis is away, try again this often


class EventHub:
    def __init__(self, redis: Any, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._watchers: dict[str, set[asyncio.Event]] = defaultdict(set)
        self._task: asyncio.Task[None] | None = None
        self.subscribed = False  # shown by /readyz; watchers fall back to polling while False

    async def start(self) -> None:
        self._task = asyncio.create_task(self._listen(), name="event-hub")

    async def stop(self) -> None:
        if self._task:
            await aio.stop(self._task)

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
        """Subscribe, relay wake-ups; on any failure (Redis away) subscribe again until it answers."""
        lost_at: float | None = None
        while True:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.psubscribe(self.keys.announce_pattern())
                self.subscribed = True
                if lost_at is not None:
                    log.info("event hub subscribed again after %.1f s", time.monotonic() - lost_at)
                    lost_at = None
                self._wake_all()  # anything announced while we were away is read now
                while True:
                    # A timeout, not listen(): the loop comes round every second, and get_message
                    # pings an idle connection (health_check_interval), so a dead one is noticed.
                    message = await pubsub.get_message(timeout=LISTEN_TIMEOUT_S)
                    if message is not None and message["type"] == "pmessage":
                        channel = message["channel"]
                        job_id = self.keys.job_id_from_announce(
                            channel.decode() if isinstance(channel, bytes) else channel
                        )
                        for watcher in self._watchers.get(job_id, ()):
                            watcher.set()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.subscribed = False
                if lost_at is None:
                    lost_at = time.monotonic()
                    log.warning("event hub lost Redis (%s: %s); resubscribing", type(exc).__name__, exc)
            finally:
                self.subscribed = False
                with suppress(Exception):
                    await pubsub.aclose()
            await asyncio.sleep(RESUBSCRIBE_S)

    def _wake_all(self) -> None:
        for watchers in self._watchers.values():
            for watcher in watchers:
                watcher.set()
