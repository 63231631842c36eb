"""A stage replica that reports itself unhealthy stops taking new batches, and takes them again later.

The rule (thresholds, cool-down, probe) is `app.core.health.judge`; this module acts on it. New
batches reach a stage as prefills on its shared Celery queue, which every replica consumes; there
is no router that could skip one replica. So the replica keeps itself away: while it is unhealthy,
its Celery consumer stops consuming the shared queue (Celery's own `cancel_task_queue`, what the
`cancel_consumer` control command does, run on the consumer's thread), and it consumes again when
the probe passes (`add_task_queue`). The other replicas of the stage, consuming the same queue,
take every new batch meanwhile. What it had already fetched (a few prefills: the task threads fetch
ahead) it hands on: `hand_on` says whether to put such a message back on the shared queue, which
it does while another live replica of the stage is not unhealthy (with none, the work runs here
rather than nowhere). Batches already running on it go on: their KV cache lives in this process, so
their decode steps keep coming over its lane (app/workers/lane.py); they are not new batches.

If every replica of a stage is unhealthy, the stage takes no new batches until one of them has
cooled down and passed its probe; jobs wait in the queue meanwhile (their `timeout_s` applies).

Who calls: the heartbeat thread calls `observe` at every beat with the replica's report; the Celery
task calls `hand_on` for each message from the shared queue; `install` adds the consumer bootstep.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from celery import Celery, bootsteps

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
        self.consuming = True  # whether the Celery consumer takes the shared queue (as applied)
        self._consumer: Any = None  # Celery's worker Consumer, once it has started
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- the heartbeat's side

    def observe(self, report: Report) -> Health:
        """Judge one report, publish the outcome (Redis record, metric) and open or close the intake."""
        now = self.clock()
        previous, self.health = self.health, judge(self.health, report, self.thresholds, now)
        if self.health != previous:
            level = logging.WARNING if self.health.state == State.UNHEALTHY else logging.INFO
            detail = f": {self.health.detail}" if self.health.detail else ""
            log.log(level, "stage %d replica %s is %s%s", self.stage, self.worker, self.health.state, detail)
        self._metric(previous)
        ttl = max(1, int(10 * self.thresholds.fresh_s))
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(self.keys.health(), self.worker, record(self.health, report, model=self.model, stage=self.stage))
        pipe.expire(self.keys.health(), ttl)
        pipe.execute()
        self._apply()
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

    # ---------------------------------------------------------------- the Celery consumer's side

    def install(self, app: Celery) -> None:
        """Let the worker's consumer be reached: a bootstep hands it over once its task consumer runs."""
        monitor = self

        class HealthGate(bootsteps.StartStopStep):  # type: ignore[misc]
            requires = {"celery.worker.consumer.tasks:Tasks"}

            def start(self, c: Any) -> None:
                monitor._attach(c)

            def stop(self, c: Any) -> None:
                monitor._attach(None)

        app.steps["consumer"].add(HealthGate)

    def _attach(self, consumer: Any) -> None:
        with self._lock:
            self._consumer = consumer
            self.consuming = True  # a (re)started consumer takes the queues it was given
        if consumer is not None:
            self._apply(now_on_this_thread=True)

    def _apply(self, *, now_on_this_thread: bool = False) -> None:
        """Make the consumer's state follow the health: Celery's queue calls run on its own thread
        (`call_soon`), unless we are on it already (the bootstep)."""
        with self._lock:
            consumer, want = self._consumer, self.health.takes_new_batches
            if consumer is None or want == self.consuming:
                return
            self.consuming = want
        change = (consumer.add_task_queue if want else consumer.cancel_task_queue, self.queue)
        if now_on_this_thread:
            change[0](change[1])
        else:
            consumer.call_soon(*change)
        log.info("stage %d replica %s %s %s", self.stage, self.worker, "consumes" if want else "left", self.queue)

    # ---------------------------------------------------------------- the task's side

    def hand_on(self) -> bool:
        """Whether a message just fetched from the shared queue should go back to it for another
        replica: this one is unhealthy and a live replica of the stage is not."""
        if self.health.takes_new_batches:
            return False
        now = self.clock()
        live = self.redis.zrangebyscore(self.keys.workers(self.model, self.stage), now - self.thresholds.fresh_s, "+inf")
        sick = not_healthy(self.redis.hgetall(self.keys.health()), now, self.thresholds.fresh_s)
        names = {w.decode() if isinstance(w, bytes) else str(w) for w in live}
        return any(w != self.worker and sick.get(w, {}).get("state") != State.UNHEALTHY for w in names)
