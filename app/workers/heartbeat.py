"""Worker liveness in Redis: each stage replica scores itself in its stage's sorted set.

Each beat also measures what the replica's health is judged on (app/core/health.py): its device's
temperature and memory use (a GPU), and the beat's own Redis round trip; `observe` gets that report.
Every `TRIM_EVERY_S` the thread also gives the C heap's free pages back (`app.core.heap.trim_heap`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from app.core import metrics
from app.core.health import Report
from app.core.heap import TRIM_EVERY_S, trim_heap
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
        observe: Callable[[Report], object] | None = None,  # each beat's health report (HealthMonitor)
        stats: Callable[[str], dict[str, Any] | None] = device_stats,  # the device's state
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
        self.observe = observe
        self.stats = stats
        self._stopping = threading.Event()

    def beat(self) -> None:
        now = time.time()
        pipe = self.redis.pipeline(transaction=False)
        pipe.zadd(self.key, {self.member: now})
        pipe.zremrangebyscore(self.key, 0, now - 10 * self.ttl_s)  # forget long-dead replicas
        pipe.expire(self.key, int(10 * self.ttl_s))
        stats = self.stats(self.device)
        if stats is not None and self.devices_key:
            pipe.hset(self.devices_key, self.member, json.dumps(stats))
            pipe.expire(self.devices_key, int(10 * self.ttl_s))
        if self.info_key and self.info is not None:
            pipe.hset(self.info_key, self.member, json.dumps({**self.info, "at": now}))
            pipe.expire(self.info_key, int(10 * self.ttl_s))
        started = time.perf_counter()
        pipe.execute()
        rtt_ms = (time.perf_counter() - started) * 1000.0
        metrics.HEARTBEAT.labels(*self.labels, self.member).set(now)
        metrics.device_observed(self.device, stats)
        if self.observe is not None:
            self.observe(Report.from_device(stats, redis_rtt_ms=rtt_ms, at=now))

    def run(self) -> None:
        trimmed = time.monotonic()
        while not self._stopping.wait(self.interval_s):
            try:
                self.beat()
            except Exception:  # Redis away for a moment: the next beat retries
                log.warning("heartbeat to Redis failed", exc_info=True)
            if time.monotonic() - trimmed >= TRIM_EVERY_S:  # the heap's free pages back to the system
                trim_heap()
                trimmed = time.monotonic()

    def stop(self) -> None:
        self._stopping.set()
        try:
            self.redis.zrem(self.key, self.member)
            if self.info_key:
                self.redis.hdel(self.info_key, self.member)
        except Exception:
            log.debug("could not withdraw heartbeat", exc_info=True)
