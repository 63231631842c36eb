"""Per-stage step latency, measured by each worker and reported to Redis for rebalancing.

`conveyor plan --rebalance` reads these figures and proposes new cut points (the seeds' dynamic
load balancing). Only the model compute of a step is timed, not queueing or messaging.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from app.core.keys import Keys

SMOOTHING = 0.1  # EWMA weight of the newest step: about the last 20 steps dominate
REPORT_EVERY_S = 1.0


@dataclass
class StepLatency:
    redis: Any
    keys: Keys
    model: str
    stage: int
    layers: tuple[int, int]
    worker: str
    ewma_s: float | None = None
    steps: int = 0
    _reported: float = field(default=0.0)

    def observe(self, seconds: float, *, now: float | None = None) -> None:
        self.steps += 1
        self.ewma_s = seconds if self.ewma_s is None else (1 - SMOOTHING) * self.ewma_s + SMOOTHING * seconds
        now = time.time() if now is None else now
        if now - self._reported >= REPORT_EVERY_S:
            self._reported = now
            self.report(now)

    def report(self, now: float) -> None:
        value = {
            "ewma_s": self.ewma_s,
            "steps": self.steps,
            "layers": list(self.layers),
            "worker": self.worker,
            "updated": now,
        }
        self.redis.hset(self.keys.latency(self.model), str(self.stage), json.dumps(value))
        self.redis.expire(self.keys.latency(self.model), 3600)


def read_latencies(redis: Any, keys: Keys, model: str) -> dict[int, dict[str, Any]]:
    """Stage -> its last report, as written by `StepLatency.report`."""
    raw = redis.hgetall(keys.latency(model))
    return {int(k): json.loads(v) for k, v in raw.items()}
