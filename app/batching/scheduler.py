"""The batcher process: intake streams -> windows and buckets -> prefill messages to stage 0.

The loop owns no policy: `windows.plan` decides what to dispatch, this module only does the I/O
around it. An intake entry is acknowledged only after its batch was handed to the broker.

Embeddings jobs come through the same intake, admission, windows, budget and stall recovery; their
kind (`EMBEDDING`, in the record and the intake entry) has a pipeline of its own,
`embedding_stages` long, and a batch of them goes to that pipeline's first queue as one
`embed_batch` message instead of a prefill.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from app.batching import fairshare, intake, windows
from app.batching.budget import REPLICA_BATCHES, Budget, Census, Ledger, Share, budget
from app.batching.recovery import MAX_ATTEMPTS, Monitor
from app.core import metrics
from app.core.config import BatcherSettings, Settings
from app.core.discovery import EMBEDDING
from app.core.jobs import JobStatus, Transition, text_of
from app.core.jobstore import JobStore
from app.core.keys import BATCH_LOG_MAXLEN, PRIORITIES, PRIORITY_ALIASES, Keys
from app.core.outcomes import Outcomes
from app.core.protocol import StepMessage, embed_batch

log = logging.getLogger(__name__)

# (message, queue): a generation batch's prefill (StepMessage), or an embeddings batch (`embed_batch`).
Send = Callable[[StepMessage | dict[str, Any], str], None]
MAX_BLOCK_MS = 1000
# Intake entries the batcher holds at once; the rest wait in Redis. About queue_depth_limit: a job
# further back waits longer than a window whatever the batcher holds.
MAX_PENDING = 1024
# With jobs ready and no room, look again this often: sequences finishing free room without a
# message (a finished batch, an arrival or a closing window wake the batcher at once).
ROOM_POLL_MS = 20
# The embeddings pipeline's share per replica: a batch per stage and one waiting (`budget` gives a
# pipeline at least stages + 1). A batch is one forward over all its rows, which a deeper queue does
# not speed up; it would only put more of one tenant's heavy batches ahead of another's one sentence,
# which fair share then picks first for the next batch.
EMBEDDING_SHARE = Share(batches=1, sequences=None)
# An urgent batch not started after this long (its worker is busy with a long step, or gone) no
# longer holds the urgent jobs that arrived after it.
URGENT_HOLD_MAX_S = 2.0
# How often the batcher looks for stalled jobs (`stall_timeout_s` says when a job is stalled).
MONITOR_INTERVAL_S = 1.0


class Batcher:
    def __init__(
        self,
        settings: BatcherSettings,
        *,
        redis: Any,
        send: Send,
        consumer: str = "batcher-0",
        clock: Callable[[], float] = time.monotonic,
        max_block_ms: int = MAX_BLOCK_MS,
    ) -> None:
        """`settings`: `Settings.batcher`. `max_block_ms`: the longest a tick waits for new work when
        nothing is pending (a test that ticks the batcher by hand, with no arrival to come, shortens it)."""
        self.settings = settings
        self.redis = redis
        self.send = send
        self.consumer = consumer
        self.clock = clock
        self.max_block_ms = max_block_ms
        self.keys = Keys(settings.namespace)
        self.jobs = JobStore(redis, self.keys, ttl_s=settings.life.ttl_s)
        self.limits = windows.Limits(
            max_batch_size=settings.max_batch_size,
            max_wait_s=settings.max_wait_s,
            length_buckets=windows.LENGTH_BUCKETS,
            aging_s=settings.aging_s,
            max_prefill_tokens=settings.max_prefill_tokens,
            min_batch_size=settings.min_batch_size,
        )
        self.pending: list[windows.Item] = []
        self.outcomes = Outcomes(redis, self.keys, self.jobs, life=settings.life)
        self.monitor = Monitor(
            redis,
            self.keys,
            stall_timeout_s=settings.stall_timeout_s,
            max_attempts=MAX_ATTEMPTS,
            ttl_s=settings.life.ended_ttl_s,  # what a job it fails keeps
            stream_maxlen=settings.life.stream_maxlen,
            stages=settings.stages_of,
            heartbeat_ttl_s=settings.heartbeat_ttl_s,
        )
        self.census = Census(
            redis, self.keys, stages=settings.stages_of, heartbeat_ttl_s=settings.heartbeat_ttl_s, clock=clock
        )
        self.share = Share(REPLICA_BATCHES, settings.max_running_sequences)
        self.ledger = Ledger(horizon_s=settings.heartbeat_ttl_s)
        self.credited: set[str] = set()  # the models on the step engine at the last dispatch round
        self.last_sweep = -float("inf")
        self.waiting_for_room = False
        # model -> (a job of its newest urgent batch, when it was dispatched) until that batch starts
        self.unstarted: dict[str, tuple[str, float]] = {}
        self.tenant_clock: dict[str, float] = {}  # tenant -> its fair-share virtual time (fairshare.py)

    def run(self, stop: threading.Event) -> None:
        intake.ensure_groups(self.redis, self.keys)
        self._take(
            intake.read(
                self.redis,
                self.keys,
                self.consumer,
                count=MAX_PENDING,
                block_ms=None,
                backlog=True,
            )
        )
        log.info("batcher up: %d jobs recovered from a previous run", len(self.pending))
        away = False  # Redis unreachable: said once, not every round
        while not stop.is_set():
            try:
                self.tick()
            except (RedisConnectionError, RedisTimeoutError) as exc:
                if not away:
                    log.warning("Redis unreachable, retrying every 0.5 s: %s", exc)
                away = True
                stop.wait(0.5)
                continue
            except Exception:  # the loop never dies on one bad round
                log.exception("batcher round failed")
                stop.wait(0.5)
            if away:
                log.info("Redis is back")
                away = False

    def tick(self) -> None:
        """One round: wait for work or a window to close, then dispatch what the plan says."""
        room = MAX_PENDING - len(self.pending)
        self._take(
            intake.read(self.redis, self.keys, self.consumer, count=max(room, 1), block_ms=self._block_ms())
        )
        if self.clock() - self.last_sweep >= MONITOR_INTERVAL_S:
            self.last_sweep = self.clock()
            self.recover()
        self.expire_late()
        self.dispatch_ready()

    def recover(self) -> None:
        """Stalled jobs go back to the intake (or fail); batches no job progresses in free their slot."""
        self.monitor.sweep()
        self.jobs.prune_batches()

    def expire_late(self) -> None:
        """Jobs still waiting at their deadline end `expired`; their entries are acknowledged."""
        late = windows.expired(self.pending, self.clock())
        if not late:
            return
        done = self.outcomes.expire(
            [it.job_id for it in late], reason="the job was not started before its timeout_s passed"
        )
        log.info("%d jobs expired in the queue", len(done))
        models = {it.job_id: it.model for it in late}
        for job_id in done:
            metrics.job_ended(models[job_id], "expired", "expired")
        intake.ack(self.redis, self.keys, [(it.stream, it.entry_id) for it in late])
        gone = {id(it) for it in late}
        self.pending = [it for it in self.pending if id(it) not in gone]

    def budgets(self, kinds: dict[str, str | None]) -> dict[str, Budget]:
        """Each model's budget now (`kinds`: model -> its jobs' kind), from its live stage replicas
        (app/batching/budget.py)."""
        budgets = {
            model: budget(live, EMBEDDING_SHARE if kinds[model] == EMBEDDING else self.share)
            for model, live in self.census.live(set(kinds)).items()
        }
        for model, b in budgets.items():
            metrics.PIPELINE_REPLICAS.labels(model).set(b.replicas)
            metrics.INFLIGHT_BUDGET.labels(model, "batches").set(b.batches)
            if b.sequences is not None:
                metrics.INFLIGHT_BUDGET.labels(model, "sequences").set(b.sequences)
        return budgets

    def dispatch_ready(self) -> None:
        models = {it.model for it in self.pending}
        if not models:
            self.waiting_for_room = False
            return
        inflight = {m: self.redis.hlen(self.keys.inflight(m)) for m in models}
        budgets = self.budgets({it.model: it.kind for it in self.pending})
        capacity = {m: b.batches for m, b in budgets.items()}
        counted = self.census.in_flight()  # every scheduled or running sequence, per model
        running = {m: counted[m] for m in models}
        room = {m: b.sequences - counted[m] for m, b in budgets.items() if b.sequences is not None}
        reserve = {
            m: windows.batch_reserve(b.sequences, self.limits)
            for m, b in budgets.items()
            if b.sequences is not None
        }
        now = self.clock()
        # A pipeline on the step engine: its replicas' credit is its room (app/batching/budget.py).
        rooms = {m: self.ledger.room(m, c, now) for m, c in self.census.credits(models).items()}
        for m, r in rooms.items():
            room[m] = r.sequences
            reserve[m] = windows.batch_reserve(r.max_sequences, self.limits)
            metrics.INFLIGHT_BUDGET.labels(m, "sequences").set(r.max_sequences)
        self.credited = set(rooms)
        weights = self.settings.tenant_weights
        self.tenant_clock = fairshare.settle(self.tenant_clock, {it.tenant for it in self.pending})
        for batch in windows.plan(
            self.pending,
            inflight=inflight,
            capacity=capacity,
            limits=self.limits,
            now=now,
            room=room or None,
            running=running,
            hold=self._held(now),
            share=self.tenant_clock,
            weights=weights,
            reserve=reserve,
            kv={m: (r.blocks, r.block_size) for m, r in rooms.items()},
        ):
            self._dispatch(batch)
            self.tenant_clock = fairshare.charge(self.tenant_clock, batch.items, weights)
        # Jobs whose window has closed and still wait: the pipeline has no room for them.
        self.waiting_for_room = any(now - it.arrived >= self.limits.max_wait_s for it in self.pending)

    def _held(self, now: float) -> set[str]:
        """Models whose newest urgent batch has not started yet (its first job is still scheduled)."""
        if not self.unstarted:
            return set()
        pipe = self.redis.pipeline(transaction=False)
        for job_id, _ in self.unstarted.values():
            pipe.hget(self.keys.job(job_id), "status")
        for (model, (_, at)), status in zip(list(self.unstarted.items()), pipe.execute(), strict=True):
            if text_of(status or b"") != JobStatus.SCHEDULED or now - at > URGENT_HOLD_MAX_S:
                del self.unstarted[model]
        return set(self.unstarted)

    def _block_ms(self) -> int:
        deadline = windows.next_deadline(self.pending, self.limits)
        if deadline is None:
            return self.max_block_ms
        wait_ms = (deadline - self.clock()) * 1000.0
        if self.waiting_for_room:  # jobs are ready but the pipeline is full: poll, don't spin
            wait_ms = max(wait_ms, ROOM_POLL_MS)
        if self.unstarted:  # look again soon: urgent jobs wait for an urgent batch to start
            wait_ms = min(wait_ms, ROOM_POLL_MS)
        return int(min(self.max_block_ms, max(1.0, wait_ms)))

    def _take(self, entries: Any) -> None:
        done: list[tuple[str, str]] = []
        for entry in entries:
            if entry.stream == self.keys.control():
                done.append((entry.stream, entry.entry_id))  # a batch finished: the next plan sees room
                continue
            self.pending.append(self._item(entry))
        if done:
            intake.ack(self.redis, self.keys, done)

    def _item(self, entry: intake.IntakeEntry) -> windows.Item:
        """An intake entry on the batcher's clock; its age counts from when it entered the stream
        (the entry id's milliseconds), so a restarted batcher keeps every job's place and age."""
        f = entry.fields
        priority = PRIORITY_ALIASES.get(f["priority"], f["priority"])
        now_unix, now = time.time(), self.clock()
        age = max(0.0, now_unix - int(entry.entry_id.split("-")[0]) / 1000.0)
        deadline = float(f["deadline"]) - now_unix + now if "deadline" in f else None
        return windows.Item(
            job_id=f["job_id"],
            model=f["model"],
            prompt_tokens=int(f["prompt_tokens"]),
            priority=PRIORITIES.index(priority) if priority in PRIORITIES else PRIORITIES.index("normal"),
            arrived=now - age,
            stream=entry.stream,
            entry_id=entry.entry_id,
            deadline=deadline,
            alone=int(f.get("attempts", "0")) >= 2,
            tenant=f.get("tenant", ""),
            max_tokens=int(f.get("max_tokens", "0")),
            kind=f.get("kind"),
        )

    def _dispatch(self, batch: windows.Batch) -> None:
        batch_id = uuid.uuid4().hex
        job_ids = [it.job_id for it in batch.items]
        now = time.time()
        moves = [
            Transition(j, JobStatus.SCHEDULED, {"batch_id": batch_id, "batch_size": len(job_ids)})
            for j in job_ids
        ]
        # One transaction: a job is never scheduled without its in-flight entry and progress score,
        # so if this process dies before the send below, the monitor finds the job stalled and
        # runs it again (a duplicate delivery of an already scheduled job is skipped, not re-run).
        pipe = self.redis.pipeline(transaction=True)
        self.jobs.progress_of(pipe, job_ids)
        for move in moves:
            self.jobs.enqueue(pipe, move, now)
        self.jobs.batch_sent(pipe, batch.model, batch_id, job_ids)
        self.jobs.progressed(job_ids, now, pipe=pipe)
        results = pipe.execute()
        self.census.dispatched(batch.model, job_ids)
        held, results = results[: len(job_ids)], results[len(job_ids) :]
        scheduled = [move.job_id for move, result in zip(moves, results, strict=False) if int(result[0])]
        if len(scheduled) < len(job_ids):
            # A job cancelled while it waited in this window was not scheduled: it takes no seat.
            # One an earlier dispatch scheduled (a batcher killed before it acknowledged the entry
            # that this one read again) keeps its progress score: if that batch never reached a
            # worker, the monitor finds the job stalled and runs it again.
            chosen = set(scheduled)
            self.jobs.unprogressed(
                [j for j, score in zip(job_ids, held, strict=True) if j not in chosen and score is None]
            )
            self.jobs.batch_narrowed(batch.model, batch_id, scheduled)
        if scheduled:
            self._observe(batch, set(scheduled))
            if batch.priority < windows.URGENT:
                self.unstarted[batch.model] = (scheduled[0], self.clock())
            message: StepMessage | dict[str, Any]
            if batch.kind == EMBEDDING:  # a job kind of its own, on its own pipeline
                message, queue = embed_batch(batch_id, scheduled), self.keys.stage_queue(batch.model, 0)
            else:
                message = StepMessage(
                    batch_id=batch_id,
                    model=batch.model,
                    stage=0,
                    num_stages=self.settings.stages,
                    kind="prefill",
                    step=0,
                    seq_ids=scheduled,
                    priority=batch.priority,
                )
                queue = self.keys.stage_queue(batch.model, 0)
            self.redis.xadd(
                self.keys.batch_log(),
                {"batch_id": batch_id, "model": batch.model, "size": len(scheduled), "bucket": batch.bucket},
                maxlen=BATCH_LOG_MAXLEN,
                approximate=True,
            )
            try:
                self.send(message, queue)
            except Exception:
                # The broker refused: put the jobs back as they were; the entries stay unacknowledged.
                self.jobs.batch_out(batch.model, batch_id)
                self.jobs.unprogressed(scheduled)
                self.jobs.apply([Transition(j, JobStatus.QUEUED) for j in scheduled], strict=False)
                raise
            log.info(
                "batch %s: %d jobs of %s (bucket %d)", batch_id[:8], len(scheduled), batch.model, batch.bucket
            )
            if batch.model in self.credited:
                sent = set(scheduled)
                prompts = [it.prompt_tokens for it in batch.items if it.job_id in sent]
                self.ledger.sent(batch.model, batch_id, prompts, self.clock())
        intake.ack(self.redis, self.keys, [(it.stream, it.entry_id) for it in batch.items])
        taken = {id(it) for it in batch.items}
        self.pending = [it for it in self.pending if id(it) not in taken]

    def _observe(self, batch: windows.Batch, scheduled: set[str]) -> None:
        now = self.clock()
        items = [it for it in batch.items if it.job_id in scheduled]
        for it in items:
            priority = PRIORITIES[it.priority] if 0 <= it.priority < len(PRIORITIES) else "normal"
            metrics.INTAKE_WAIT.labels(batch.model, priority).observe(max(0.0, now - it.arrived))
        metrics.BATCH_SIZE.labels(batch.model).observe(len(items))
        longest = max(it.prompt_tokens for it in items)
        padding = 1.0 - sum(it.prompt_tokens for it in items) / (longest * len(items)) if longest else 0.0
        metrics.BATCH_PADDING.labels(batch.model).observe(padding)


def run_batcher(settings: Settings) -> None:
    """Entry point of the batcher process."""
    import signal

    from app.core.broker import create_celery_app, send_embedding, send_step
    from app.core.redis import sync_client

    url = settings.redis_url or ""
    celery = create_celery_app(settings, url)

    def send(message: StepMessage | dict[str, Any], queue: str) -> None:
        if isinstance(message, StepMessage):
            send_step(celery, message, queue)
        else:
            send_embedding(celery, message, queue)

    metrics.serve(settings.metrics_port, "batcher", settings.api_host)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    Batcher(settings.batcher, redis=sync_client(url), send=send).run(stop)
