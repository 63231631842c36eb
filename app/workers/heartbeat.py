"""Worker liveness in Redis: each stage replica scores itself in its stage's sorted set."""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

from app.core import metrics
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
        labels: tuple[str, str] = ("", ""),  # (model, stage) of the heartbeat metric
        info_key: str | None = None,  # where the worker says what it serves (shown by /readyz)
        info: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(name="heartbeat", daemon=True)
        self.redis = redis
        self.key = key
        self.member = member
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        self.devices_key = devices_key
        self.device = device
        self.labels = labels
        self.info_key = info_key
        self.info = info
        self._stopping = threading.Event()

    def beat(self) -> None:
        now = time.time()
        pipe = self.redis.pipeline(transaction=False)
        pipe.zadd(self.key, {self.member: now})
        pipe.zremrangebyscore(self.key, 0, now - 10 * self.ttl_s)  # forget long-dead replicas
        pipe.expire(self.key, int(10 * self.ttl_s))
        stats = device_stats(self.device)
        if stats is not None and self.devices_key:
            pipe.hset(self.devices_key, self.member, json.dumps(stats))
            pipe.expire(self.devices_key, int(10 * self.ttl_s))
        if self.info_key and self.info is not None:
            pipe.hset(self.info_key, self.member, json.dumps({**self.info, "at": now}))
            pipe.expire(self.info_key, int(10 * self.ttl_s))
        pipe.execute()
        metrics.HEARTBEAT.labels(*self.labels, self.member).set(now)
        metrics.device_observed(self.device, stats)

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
            if self.info_key:
                self.redis.hdel(self.info_key, self.member)
        except Exception:
            log.debug("could not withdraw heartbeat", exc_info=True)
