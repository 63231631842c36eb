"""Stage 0's choice of the replica of each later stage its plans go to (a pipeline of several
stages on the step engine: `app.workers.engine.runtime`).

A later stage's replica holds the keys and values its stage computed for stage 0's sequences, so
every plan of a stage 0 goes to the same replicas: picked once among the live ones (a heartbeat
within `ttl_s`), spread over them by stage 0's own name, and kept while their heartbeats are.
Replicas that lost plans are shunned while their heartbeats may still look live.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, field
from typing import Any

from app.core.jobs import text_of
from app.core.keys import Keys

CHECK_S = 5.0  # the replicas' heartbeats are read again this often


@dataclass
class Routes:
    redis: Any
    keys: Keys
    model: str
    num_stages: int
    me: str  # stage 0's worker
    ttl_s: float
    lanes: list[str] = field(default_factory=list)  # of stages 1 to N - 1; empty: none picked
    workers: list[str] = field(default_factory=list)
    checked_at: float = 0.0
    shunned: dict[str, float] = field(default_factory=dict)  # worker -> until when

    def due(self, now: float) -> bool:
        return now - self.checked_at > CHECK_S

    def check(self) -> bool | None:
        """None: the replicas picked are still live (or were checked less than CHECK_S ago). False:
        one of them stopped (the caller drops what it sent them, then picks again). True: none is
        picked yet."""
        now = time.monotonic()
        if not self.lanes:
            return True
        if not self.due(now):
            return None
        self.checked_at = now
        live = self._live()
        if all(w in alive for w, alive in zip(self.workers, live, strict=True)):
            return None
        return False

    def drop(self, *, shun: bool) -> None:
        """Forget the replicas picked; with `shun`, do not pick them again for a heartbeat's lifetime."""
        if shun:
            self.shunned.update(dict.fromkeys(self.workers, time.monotonic() + self.ttl_s))
        self.lanes, self.workers = [], []

    def pick(self) -> bool:
        """Pick a live replica of each later stage (not a shunned one); False if a stage has none."""
        now = time.monotonic()
        self.checked_at = now
        self.shunned = {w: until for w, until in self.shunned.items() if until > now}
        live = [[w for w in alive if w not in self.shunned] for alive in self._live()]
        if not all(live):
            return False
        me = zlib.crc32(self.me.encode())
        self.workers = [alive[me % len(alive)] for alive in live]
        self.lanes = [self.keys.lane(self.model, k, w) for k, w in enumerate(self.workers, start=1)]
        return True

    def _live(self) -> list[list[str]]:
        since = time.time() - self.ttl_s
        pipe = self.redis.pipeline(transaction=False)
        for stage in range(1, self.num_stages):
            pipe.zrangebyscore(self.keys.workers(self.model, stage), since, "+inf")
        return [sorted(map(text_of, workers)) for workers in pipe.execute()]
