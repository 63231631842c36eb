"""Worker liveness in Redis: each stage replica scores itself in its stage's sorted set."""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

from app.workers.device import device_stats

log = logging.getLogger(__name__)


class Heartbeat(threading.Thread):
    def __init__(
        self,
        redis: Any,
        key: str,
        member: str,
        *,
        interval_s: float,
        ttl_s: float,
        devices_key: str | None = None,  # where GPU workers report their device's state
        device: str = "cpu",
    ) -> None:
        super().__init__(name="heartbeat", daemon=True)
        self.redis = redis
        self.key = key
        self.member = member
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        self.devices_key = devices_key
        self.device = device
        self._stopping = threading.Event()

    def beat(self) -> None:
        now = time.time()
        pipe = self.redis.pipeline(transaction=False)
        pipe.zadd(self.key, {self.member: now})
        pipe.zremrangebyscore(self.key, 0, now - 10 * self.ttl_s)  # forget long-dead replicas
        pipe.expire(self.key, int(10 * self.ttl_s))
        stats = device_stats(self.device) if self.devices_key else None
        if stats is not None:
            pipe.hset(self.devices_key, self.member, json.dumps(stats))
            pipe.expire(self.devices_key, int(10 * self.ttl_s))
        pipe.execute()

    def run(self) -> None:
        while not self._stopping.wait(self.interval_s):
            try:
                self.beat()
            except Exception:  # Redis away for a moment: the next beat retries
                log.warning("heartbeat to Redis failed", exc_info=True)

    def stop(self) -> None:
        self._stopping.set()
        try:
            self.redis.zrem(self.key, self.member)
        except Exception:
            log.debug("could not withdraw heartbeat", exc_info=True)
