"""The batcher process: intake streams -> windows and buckets -> prefill messages to stage 0.

The loop owns no policy: `windows.plan` decides what to dispatch, this module only does the I/O
around it. An intake entry is acknowledged only after its batch was handed to the broker.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from app.batching import intake, windows
from app.core.config import Settings
from app.core.jobs import JobStatus, JobStore, Transition
from app.core.keys import BATCH_LOG_MAXLEN, PRIORITIES, Keys
from app.core.protocol import StepMessage

log = logging.getLogger(__name__)

Send = Callable[[StepMessage, str], None]
MAX_BLOCK_MS = 1000


class Batcher:
    def __init__(
        self,
        settings: Settings,
        *,
        redis: Any,
        send: Send,
        consumer: str = "batcher-0",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.redis = redis
        self.send = send
        self.consumer = consumer
        self.clock = clock
        self.keys = Keys(settings.namespace)
        self.jobs = JobStore(redis, self.keys, ttl_s=settings.job_ttl_s)
        self.limits = windows.Limits(
            max_batch_size=settings.max_batch_size,
            max_wait_s=settings.max_wait_ms / 1000.0,
            length_buckets=tuple(sorted(settings.length_buckets)),
        )
        self.pending: list[windows.Item] = []
        self.stages = settings.stages

    def run(self, stop: threading.Event) -> None:
        intake.ensure_groups(self.redis, self.keys)
        self._take(
            intake.read(
                self.redis,
                self.keys,
                self.consumer,
                count=self.settings.batcher_max_pending,
                block_ms=None,
                backlog=True,
            )
        )
        log.info("batcher up: %d jobs recovered from a previous run", len(self.pending))
        while not stop.is_set():
            try:
                self.tick()
            except Exception:  # the loop never dies on one bad round; Redis may be back next time
                log.exception("batcher round failed")
                stop.wait(0.5)

    def tick(self) -> None:
        """One round: wait for work or a window to close, then dispatch what the plan says."""
        room = self.settings.batcher_max_pending - len(self.pending)
        self._take(
            intake.read(self.redis, self.keys, self.consumer, count=max(room, 1), block_ms=self._block_ms())
        )
        self.dispatch_ready()

    def dispatch_ready(self) -> None:
        models = {it.model for it in self.pending}
        inflight = {m: self.redis.hlen(self.keys.inflight(m)) for m in models}
        capacity = {m: self.settings.inflight_limit(self.stages) for m in models}
        for batch in windows.plan(
            self.pending, inflight=inflight, capacity=capacity, limits=self.limits, now=self.clock()
        ):
            self._dispatch(batch)

    def _block_ms(self) -> int:
        deadline = windows.next_deadline(self.pending, self.limits)
        if deadline is None:
            return MAX_BLOCK_MS
        return int(min(MAX_BLOCK_MS, max(1.0, (deadline - self.clock()) * 1000.0)))

    def _take(self, entries: Any) -> None:
        done: list[tuple[str, str]] = []
        for entry in entries:
            if entry.stream == self.keys.control():
                done.append((entry.stream, entry.entry_id))  # a batch finished: the next plan sees room
                continue
            f = entry.fields
            self.pending.append(
                windows.Item(
                    job_id=f["job_id"],
                    model=f["model"],
                    prompt_tokens=int(f["prompt_tokens"]),
                    priority=PRIORITIES.index(f["priority"]),
                    arrived=self.clock(),
                    stream=entry.stream,
                    entry_id=entry.entry_id,
                )
            )
        if done:
            intake.ack(self.redis, self.keys, done)

    def _dispatch(self, batch: windows.Batch) -> None:
        batch_id = uuid.uuid4().hex
        job_ids = [it.job_id for it in batch.items]
        scheduled = self.jobs.apply(
            [
                Transition(j, JobStatus.SCHEDULED, {"batch_id": batch_id, "batch_size": len(job_ids)})
                for j in job_ids
            ],
            strict=False,  # a duplicate delivery of an already scheduled job is skipped, not re-run
        )
        if scheduled:
            message = StepMessage(
                batch_id=batch_id,
                model=batch.model,
                stage=0,
                num_stages=self.stages,
                kind="prefill",
                step=0,
                seq_ids=scheduled,
            )
            pipe = self.redis.pipeline(transaction=False)
            pipe.hset(self.keys.inflight(batch.model), batch_id, json.dumps(scheduled))
            pipe.xadd(
                self.keys.batch_log(),
                {"batch_id": batch_id, "model": batch.model, "size": len(scheduled), "bucket": batch.bucket},
                maxlen=BATCH_LOG_MAXLEN,
                approximate=True,
            )
            pipe.execute()
            try:
                self.send(message, self.keys.stage_queue(batch.model, 0))
            except Exception:
                # The broker refused: put the jobs back as they were; the entries stay unacknowledged.
                self.redis.hdel(self.keys.inflight(batch.model), batch_id)
                self.jobs.apply([Transition(j, JobStatus.QUEUED) for j in scheduled], strict=False)
                raise
            log.info(
                "batch %s: %d jobs of %s (bucket %d)", batch_id[:8], len(scheduled), batch.model, batch.bucket
            )
        intake.ack(self.redis, self.keys, [(it.stream, it.entry_id) for it in batch.items])
        taken = {id(it) for it in batch.items}
        self.pending = [it for it in self.pending if id(it) not in taken]


def run_batcher(settings: Settings) -> None:
    """Entry point of the batcher process."""
    import signal

    from app.core.protocol import STEP_TASK
    from app.core.redis import sync_client
    from app.workers.celery_app import create_celery_app

    url = settings.redis_url or ""
    celery = create_celery_app(settings, url)

    def send(message: StepMessage, queue: str) -> None:
        celery.send_task(STEP_TASK, args=[message.to_wire()], queue=queue)

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    Batcher(settings, redis=sync_client(url), send=send).run(stop)
