"""A stage replica that reports itself unhealthy stops taking new batches, and takes them again later.

The rule (thresholds, cool-down, probe) is `app.core.health.judge`; this module acts on it. New
batches reach a stage as prefills on its shared Celery queue, which every replica consumes; there
is no router that could skip one replica, so the replica keeps itself away, with nothing but the
queue's own semantics: a message it fetches from the shared queue while it is unhealthy goes back to
that queue for another replica (`hand_on`), and the task thread that handed it on then waits until
the replica is healthy again (at most a cool-down at a time) before it returns. Celery fetches at
most one message per task thread ahead (prefetch multiplier 1, acknowledged late), so once each of
its task threads holds one handed-on message the replica fetches nothing more: the other replicas
of its stage take every new batch. When it recovers, the threads return (the messages they hold are
acknowledged: their copies have run elsewhere) and it fetches again. Batches already running on it
go on: their KV cache lives in this process, so their decode steps keep coming over its lane
(app/workers/lane.py); they are not new batches.

With no other live replica of the stage that is not unhealthy, the message runs here: slower work
beats none. (Celery's cancel_consumer / add_consumer would be the other way to stop fetching; on
kombu's Redis transport, consuming a queue again while a BRPOP was in flight desynchronised the
connection and crashed the worker, so it is not used.)

Who calls: the heartbeat thread calls `observe` at every beat with the replica's report; the stage
task's handler for the shared queue is `gated`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from app.core import metrics
from app.core.health import Health, Report, State, Thresholds, judge, not_healthy, record
from app.core.keys import Keys

log = logging.getLogger(__name__)


class HealthMonitor:
    def __init__(
        self,
        redis: Any,
        keys: Keys,
        *,
        model: str,
        stage: int,
        worker: str,
        queue: str,
        thresholds: Thresholds,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.model = model
        self.stage = stage
        self.worker = worker
        self.queue = queue
        self.thresholds = thresholds
        self.clock = clock
        self.health = Health()
        self.handed_on = 0  # messages put back on the shared queue for another replica
        self._recovered = threading.Event()  # set while the replica takes new batches
        self._recovered.set()
        self._stopping = False

    # ---------------------------------------------------------------- the heartbeat's side

    def observe(self, report: Report) -> Health:
        """Judge one report, publish the outcome (Redis record, metric), and release the task threads
        holding handed-on messages once the replica takes new batches again."""
        now = self.clock()
        previous, self.health = self.health, judge(self.health, report, self.thresholds, now)
        if self.health != previous:
            level = logging.WARNING if self.health.state == State.UNHEALTHY else logging.INFO
            detail = f": {self.health.detail}" if self.health.detail else ""
            log.log(level, "stage %d replica %s is %s%s", self.stage, self.worker, self.health.state, detail)
        self._metric(previous)
        ttl = max(1, int(10 * self.thresholds.fresh_s))
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(
            self.keys.health(), self.worker, record(self.health, report, model=self.model, stage=self.stage)
        )
        pipe.expire(self.keys.health(), ttl)
        pipe.execute()
        if self.health.takes_new_batches or self._stopping:
            self._recovered.set()
        else:
            self._recovered.clear()
        return self.health

    def _metric(self, previous: Health) -> None:
        """conveyor_stage_unhealthy: 1 with the crossed threshold as `reason` while unhealthy, no series
        otherwise (so `max by (...)` and the alert see only replicas that are unhealthy now)."""
        labels = (self.model, str(self.stage), self.worker)
        if previous.cause is not None and previous.cause != self.health.cause:
            metrics.STAGE_UNHEALTHY.remove(*labels, str(previous.cause))
        if self.health.cause is not None:
            metrics.STAGE_UNHEALTHY.labels(*labels, str(self.health.cause)).set(1)

    def withdraw(self) -> None:
        """At shutdown: this replica's record goes (it is not unhealthy; it is gone)."""
        self.redis.hdel(self.keys.health(), self.worker)

    def wait_until_healthy(self, timeout_s: float) -> bool:
        """Block the calling task thread until the replica takes new batches again (or `timeout_s`, or
        `stop`); True when it does."""
        return self._recovered.wait(timeout_s)

    def stop(self) -> None:
        """At shutdown: release the task threads waiting in `wait_until_healthy`, for good."""
        self._stopping = True
        self._recovered.set()

    # ---------------------------------------------------------------- the task's side

    def hand_on(self) -> bool:
        """Whether a message just fetched from the shared queue should go back to it for another
        replica: this one is unhealthy and a live replica of the stage is not."""
        if self.health.takes_new_batches:
            return False
        now = self.clock()
        live = self.redis.zrangebyscore(
            self.keys.workers(self.model, self.stage), now - self.thresholds.fresh_s, "+inf"
        )
        sick = not_healthy(self.redis.hgetall(self.keys.health()), now, self.thresholds.fresh_s)
        names = {w.decode() if isinstance(w, bytes) else str(w) for w in live}
        return any(w != self.worker and sick.get(w, {}).get("state") != State.UNHEALTHY for w in names)


def gated(
    monitor: HealthMonitor,
    handle: Callable[[dict[str, Any]], None],
    hand_on: Callable[[dict[str, Any]], None],
) -> Callable[[dict[str, Any]], None]:
    """The stage task's handler for the shared queue: a message fetched while this replica is
    unhealthy goes back to the queue (`hand_on`) when another replica can take it, and the thread
    then holds its fetch slot until the replica recovers; the rest go to `handle`."""

    def from_shared_queue(wire: dict[str, Any]) -> None:
        if monitor.hand_on():
            hand_on(wire)
            monitor.handed_on += 1
            while not monitor.wait_until_healthy(monitor.thresholds.cooldown_s or 1.0):
                if not monitor.hand_on():  # no other replica left to take new batches: serve again
                    break
            return
        handle(wire)

    return from_shared_queue
