"""Admission at submit: is the model's pipeline up, is there room, can the job meet its deadline?

The gates, in order; the first that refuses answers, with a Retry-After:

0. Redis's `used_memory` at or past HIGH_WATER of its `maxmemory`      -> 503 store_full
   (read at most once a second per API process; below `maxmemory`, so that running jobs' tokens,
   heartbeats, the batcher and the workers always have room to write);
1. a stage of the model's pipeline without a live worker for longer than `stage_down_after_s`
   (2 x heartbeat_ttl_s)                                              -> 503 stage_unavailable
   (shorter gaps are a worker being restarted: jobs accepted meanwhile wait in the intake);
2. the model's circuit breaker is open, or half-open with its probe out -> 503 circuit_open;
3. jobs waiting over every class >= 2 x `queue_depth_limit`            -> 503 overloaded;
4. jobs waiting in the job's class >= `queue_depth_limit`              -> 429 queue_full;
5. the predicted queue wait is longer than the job's `timeout_s`       -> 429 deadline_unmeetable;
6. the tenant's jobs waiting in the job's class >= its share of `queue_depth_limit`
   (`AdmissionSettings.tenant_queue_limit`)                            -> 429 tenant_queue_full;
7. the bytes the tenant's jobs hold in Redis (live, and ended until their records expire), with
   this one's, over its quota (`AdmissionSettings.retained_quota`)     -> 429 tenant_quota_exceeded.

"Waiting" is the length of a class's intake stream: the batcher deletes an entry once its job is
dispatched. Gates 3 and 4 are checked again inside the script that writes the job (`ADMIT_LUA`,
app/core/jobstore.py), so concurrent submits cannot overshoot a limit; 1, 2 and 5 are judgements,
read once. Gates 6 and 7 are
checked by that script only, so one tenant's share holds however many API processes submit for it.
A tenant's waiting jobs are counted from the job store's `tenant_waiting` set, which holds a job
exactly while it is queued or recovering (the store adds and removes it with each move), so a job
cancelled, expired or scheduled stops counting at once, before the batcher deletes its intake entry.

Predicted wait (gate 5):  W = A / R, where
  A = jobs waiting in the job's class and every higher one (they start before it), and
  R = the model's measured completion rate: jobs that ended (succeeded or failed) within the
      breaker's interval, divided by the time since the first of them ended (at least 1 s).
No job ended within the interval (a cold or idle model): no prediction, no refusal. A is counted
over every model (the intake streams are per class), so with several models it errs high.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from app.core import breaker, routing
from app.core.config import AdmissionLimits, AdmissionSettings
from app.core.durability import FsyncWatch, wait_on_disk
from app.core.errors import (
    CircuitOpen,
    DeadlineUnmeetable,
    Overloaded,
    QueueFull,
    StageUnavailable,
    StoreFull,
    TenantQueueFull,
    TenantQuotaExceeded,
)
from app.core.jobrecord import JobRecord
from app.core.jobstore import AsyncJobStore
from app.core.keys import PRIORITIES, Keys

MAX_RETRY_AFTER_S = 60.0  # a drain estimate past a minute is a guess; ask again within one
# Gate 0: submits stop at this share of Redis's maxmemory. The tenth left holds what running jobs
# still write (64 sequences x 1,024 tokens x ~80 B is 5 MB) and the heartbeats many times over.
HIGH_WATER = 0.9
MEMORY_READ_S = 1.0  # how stale the used_memory gate 0 reads may be
STORE_FULL_RETRY_S = 30.0
FSYNC_TIMEOUT_MS = 1000  # submit_durability=fsync: WAITAOF waits this long for the disk; past it 503
STAGE_MARK_TTL_S = 86_400  # a stage-down mark is deleted when a worker is back; this only bounds it


@dataclass(frozen=True)
class StageSeen:
    """One stage of a model's pipeline as its heartbeats show it."""

    stage: int
    last_beat: float | None  # the newest heartbeat of any of its workers (unix seconds)
    marked_down: float | None  # since when an API process has seen it without a live worker


def down_since(seen: StageSeen, *, now: float, ttl_s: float) -> float | None:
    """Since when the stage has had no live worker; None while one is live.

    A stage with a stale heartbeat has been down since that beat plus the TTL; one with no
    heartbeat at all (a worker that withdrew, a key that expired) since an API process first saw it
    so (the mark), unless a worker has beaten since the mark was set (then the mark is stale)."""
    if seen.last_beat is not None and seen.last_beat >= now - ttl_s:
        return None
    if seen.marked_down is not None and (seen.last_beat is None or seen.last_beat <= seen.marked_down):
        return seen.marked_down
    if seen.last_beat is not None:
        return seen.last_beat + ttl_s
    return now


def check_stages(
    model: str, stages: Sequence[StageSeen], *, now: float, ttl_s: float, after_s: float
) -> None:
    """Gate 1: refuse when a stage has been without a live worker for longer than `after_s`."""
    for seen in stages:
        since = down_since(seen, now=now, ttl_s=ttl_s)
        if since is not None and now - since > after_s:
            raise StageUnavailable(
                f"stage {seen.stage} of the {model} pipeline has had no live worker for "
                f"{now - since:.0f} s; retry later",
                retry_after_s=ttl_s,
                model=model,
                stage=seen.stage,
                down_for_s=round(now - since, 1),
            )


def waiting_ahead(depths: Mapping[str, int], priority: str) -> int:
    """Jobs that start before a new job of `priority`: its class and every higher one."""
    return sum(depths.get(p, 0) for p in PRIORITIES[: PRIORITIES.index(priority) + 1])


def predicted_wait_s(depths: Mapping[str, int], priority: str, rate: float | None) -> float | None:
    """W = A / R (module docstring); None without a measured rate."""
    if not rate:
        return None
    return waiting_ahead(depths, priority) / rate


def drain_s(excess: int, rate: float | None, fallback_s: float) -> float:
    """Seconds until `excess` jobs have left at the measured rate (the fallback without one)."""
    if not rate:
        return fallback_s
    return min(MAX_RETRY_AFTER_S, max(1.0, excess / rate))


def check_load(
    depths: Mapping[str, int], priority: str, *, limits: AdmissionLimits, rate: float | None
) -> None:
    """Gates 3 and 4 (the write script checks them again, atomically)."""
    overload(sum(depths.values()), limits=limits, rate=rate)
    queue_full(depths.get(priority, 0), priority, limits=limits, rate=rate)


def overload(total: int, *, limits: AdmissionLimits, rate: float | None) -> None:
    if total >= limits.overall:
        raise Overloaded(
            f"{total} jobs are waiting, the most this service queues; retry later",
            retry_after_s=drain_s(total - limits.overall + 1, rate, limits.retry_after_s),
            waiting=total,
            limit=limits.overall,
        )


def queue_full(depth: int, priority: str, *, limits: AdmissionLimits, rate: float | None) -> None:
    if depth >= limits.class_depth:
        raise QueueFull(
            f"{depth} {priority} jobs are waiting, the most this class queues; retry later",
            retry_after_s=drain_s(depth - limits.class_depth + 1, rate, limits.retry_after_s),
            priority=priority,
            waiting=depth,
            limit=limits.class_depth,
        )


def tenant_queue_full(
    waiting: int, priority: str, *, limit: int, limits: AdmissionLimits, rate: float | None
) -> None:
    """Gate 6 (the write script's answer). Retry-After as for the class at the measured rate: the
    tenant's jobs leave no faster than all of them."""
    if waiting >= limit:
        raise TenantQueueFull(
            f"{waiting} of your {priority} jobs are waiting, your share of this class's queue; retry later",
            retry_after_s=drain_s(waiting - limit + 1, rate, limits.retry_after_s),
            priority=priority,
            waiting=waiting,
            limit=limit,
        )


def check_deadline(
    depths: Mapping[str, int], priority: str, timeout_s: float | None, rate: float | None
) -> None:
    """Gate 5: refuse a job whose predicted queue wait already exceeds its timeout_s."""
    wait = predicted_wait_s(depths, priority, rate)
    if timeout_s is None or wait is None or wait <= timeout_s:
        return
    raise DeadlineUnmeetable(
        f"about {wait:.1f} s of queue is ahead of this job ({waiting_ahead(depths, priority)} jobs at "
        f"{rate:.2f} jobs/s), longer than its timeout_s of {timeout_s:g}",
        retry_after_s=min(MAX_RETRY_AFTER_S, wait - timeout_s),
        predicted_wait_s=round(wait, 1),
        timeout_s=timeout_s,
    )


@dataclass(frozen=True)
class Memory:
    """Redis's INFO memory, as gate 0 last read it."""

    used: int
    maxmemory: int  # 0: no bound
    read_at: float  # monotonic

    @property
    def over(self) -> bool:
        """At or past the high-water mark."""
        return bool(self.maxmemory) and self.used >= HIGH_WATER * self.maxmemory


def check_memory(memory: Memory) -> None:
    """Gate 0: refuse new work once Redis is at its high-water mark."""
    if memory.over:
        raise StoreFull(
            f"the job store (Redis) holds {memory.used} bytes, {memory.used / memory.maxmemory:.0%} of its "
            f"maxmemory; it takes no new work past {HIGH_WATER:.0%}; retry later",
            retry_after_s=STORE_FULL_RETRY_S,
            reason="high_water",
            used_memory=memory.used,
            maxmemory=memory.maxmemory,
        )


def tenant_quota(detail: str, *, limit: int, now: float) -> TenantQuotaExceeded:
    """Gate 7 (the write script's answer: the bytes held and when the oldest job expires, unix ms)."""
    held, _, oldest_ms = detail.partition(" ")
    return TenantQuotaExceeded(
        f"your jobs hold {int(held)} bytes of the job store, your quota is {limit}; room comes back as "
        "your oldest jobs expire",
        retry_after_s=max(1.0, float(oldest_ms) / 1000 - now),
        retained_bytes=int(held),
        limit=limit,
    )


@dataclass(frozen=True)
class Ticket:
    """A job that passed the gates: what the write needs to know."""

    model: str
    priority: str
    probe: bool  # it is the half-open breaker's probe: the claim is released if it is not written
    rate: float | None


@dataclass(frozen=True)
class Written:
    """The write's outcome: the job was queued, or `held` names the job its Idempotency-Key made."""

    held: str | None = None
    existed: bool = False  # a job with the record's id exists already: nothing was written


class Admission:
    """The gates and the write, over redis.asyncio; one per API process. `settings`:
    `Settings.admission`."""

    def __init__(self, redis: Any, keys: Keys, settings: AdmissionSettings) -> None:
        self.redis = redis
        self.keys = keys
        self.settings = settings
        self.limits = settings.limits
        self.breaker = breaker.Breaker(redis, keys, settings.breaker)
        self.store = AsyncJobStore(redis, keys)
        self.fsync: FsyncWatch | None = None  # CONVEYOR_SUBMIT_DURABILITY=fsync (set at the API's start)
        self._memory: Memory | None = None

    async def memory(self) -> Memory:
        """Redis's memory use (INFO memory), read at most every MEMORY_READ_S while under the
        high-water mark and at every call past it, so that submits resume as soon as there is room."""
        now = time.monotonic()
        last = self._memory
        if last is None or last.over or now - last.read_at >= MEMORY_READ_S:
            info = await self.redis.info("memory")
            last = self._memory = Memory(int(info["used_memory"]), int(info.get("maxmemory", 0)), now)
        return last

    def refused_for_memory(self) -> None:
        """Redis refused a write at its maxmemory (any write of a request: the rate limiter's, the
        submit's): whatever gate 0 last read, the next submit reads INFO memory again, instead of
        passing on a reading of up to MEMORY_READ_S ago into a Redis that has just freed a little."""
        self._memory = None

    async def depths(self) -> dict[str, int]:
        """Jobs waiting per priority class."""
        pipe = self.redis.pipeline(transaction=False)
        for priority in PRIORITIES:
            pipe.xlen(self.keys.intake(priority))
        return dict(zip(PRIORITIES, map(int, await pipe.execute()), strict=True))

    async def read(self, model: str, now: float) -> tuple[list[StageSeen], breaker.Snapshot, dict[str, int]]:
        """Everything the gates look at, in one round trip: per stage its newest heartbeat and down
        mark, the model's breaker, the depth of every class. Down marks are then set or cleared."""
        stages = self.settings.stages_of(model)
        pipe = self.redis.pipeline(transaction=False)
        for stage in range(stages):
            pipe.zrevrange(self.keys.workers(model, stage), 0, 0, withscores=True)
            pipe.get(self.keys.stage_down(model, stage))
        snapshot = self.breaker.read(pipe, model, now)
        for priority in PRIORITIES:
            pipe.xlen(self.keys.intake(priority))
        replies = await pipe.execute()
        n = 2 * stages
        seen = []
        for stage in range(stages):
            newest, mark = replies[2 * stage], replies[2 * stage + 1]
            last = float(newest[0][1]) if newest else None
            seen.append(StageSeen(stage, last, float(mark) if mark else None))
        snap = snapshot.parse(replies[n : n + snapshot.replies])
        depths = dict(zip(PRIORITIES, map(int, replies[n + snapshot.replies :]), strict=True))
        await self._mark(model, seen, now)
        return seen, snap, depths

    async def _mark(self, model: str, seen: list[StageSeen], now: float) -> None:
        """Remember since when a stage has been down (or forget it): shared by every API process."""
        ttl = self.settings.heartbeat_ttl_s
        pipe = self.redis.pipeline(transaction=False)
        for s in seen:
            since = down_since(s, now=now, ttl_s=ttl)
            if since is None and s.marked_down is not None:
                pipe.delete(self.keys.stage_down(model, s.stage))
            elif since is not None and since != s.marked_down:
                pipe.set(self.keys.stage_down(model, s.stage), repr(since), ex=STAGE_MARK_TTL_S)
        if len(pipe):
            await pipe.execute()

    async def check(self, *, model: str, priority: str, timeout_s: float | None, now: float) -> Ticket:
        """Run gates 0-5 for one job (one round trip of reads, and INFO memory once a second); raise
        the first refusal."""
        check_memory(await self.memory())
        seen, snap, depths = await self.read(model, now)
        check_stages(
            model,
            seen,
            now=now,
            ttl_s=self.settings.heartbeat_ttl_s,
            after_s=self.settings.stage_down_after_s,
        )
        policy = self.breaker.policy
        verdict = breaker.decide(snap, policy, now)
        if verdict.action == breaker.Action.TRIP:
            await self.breaker.trip(model, snap, now)
        if verdict.action in (breaker.Action.TRIP, breaker.Action.REFUSE):
            raise self._open(model, verdict.retry_after_s, verdict.reason)
        rate = snap.completion_rate(now, policy.interval_s)
        check_load(depths, priority, limits=self.limits, rate=rate)
        check_deadline(depths, priority, timeout_s, rate)
        probe = False
        if verdict.action == breaker.Action.PROBE:
            probe = await self.breaker.claim_probe(model, now)
            if not probe:  # another submit claimed it first
                raise self._open(
                    model, min(policy.interval_s, self.limits.retry_after_s), "a probe job is out"
                )
        return Ticket(model=model, priority=priority, probe=probe, rate=rate)

    async def outlook(self, model: str, priority: str, now: float) -> routing.PipelineState:
        """What the gates would see for a job of `model` now, without refusing: for routing
        (app/core/routing.py), which takes another model rather than meet a refusal or a long queue.
        Up: every stage has a live worker now (not after the grace of gate 1: a route need not
        wait for a restart when another pipeline is up) and the breaker admits (or lets a probe)."""
        seen, snap, depths = await self.read(model, now)
        ttl = self.settings.heartbeat_ttl_s
        live = all(down_since(s, now=now, ttl_s=ttl) is None for s in seen)
        verdict = breaker.decide(snap, self.breaker.policy, now)
        admits = verdict.action not in (breaker.Action.TRIP, breaker.Action.REFUSE)
        rate = snap.completion_rate(now, self.breaker.policy.interval_s)
        wait = predicted_wait_s(depths, priority, rate)
        return routing.PipelineState(up=live and admits, predicted_wait_s=wait)

    def _open(self, model: str, retry_after_s: float, reason: str) -> CircuitOpen:
        return CircuitOpen(
            f"the circuit breaker of the {model} pipeline is open ({reason}); retry later",
            retry_after_s=retry_after_s,
            model=model,
        )

    async def write(
        self,
        ticket: Ticket,
        *,
        record: JobRecord,
        intake: Mapping[str, str],
        idempotency: tuple[str, str] | None,
        callback_at: float | None = None,
    ) -> Written:
        """Queue the job (record + intake entry + Idempotency-Key) if the limits still hold, atomically.
        With `callback_at` (a job with a callback_url) the job is registered with the webhook
        dispatcher (app/webhooks/dispatcher.py) in the same script, scored by that time."""
        ttl = self.settings.life.ttl_s  # job_ttl_s: the key lives as long as its job may
        tenant_depth = self.settings.tenant_queue_limit(record.tenant)
        tenant_bytes = self.settings.retained_quota(record.tenant, (await self.memory()).maxmemory)
        try:
            # A store that cannot keep the job on disk now (reconfigured, replaced) is not written to.
            fsync = None if self.fsync is None else await self.fsync.mode()
            outcome, detail = await self.store.admit(
                record,
                intake=intake,
                class_depth=self.limits.class_depth,
                overall=self.limits.overall,
                tenant_depth=tenant_depth,
                tenant_bytes=tenant_bytes,
                ttl_s=self.settings.life.ttl_s,
                idempotency=None if idempotency is None else (*idempotency, ttl),
                callback_at=callback_at,
            )
            if outcome == "ok":
                if fsync is not None:
                    await wait_on_disk(self.redis, fsync, FSYNC_TIMEOUT_MS)
                return Written()
            if outcome == "exists":
                if ticket.probe:
                    await self.breaker.release_probe(ticket.model)
                return Written(existed=True)
            if outcome == "held":
                if ticket.probe:
                    await self.breaker.release_probe(ticket.model)
                return Written(held=detail)
            if outcome == "overloaded":
                overload(int(detail), limits=self.limits, rate=ticket.rate)
            if outcome == "tenant_quota":
                raise tenant_quota(detail, limit=tenant_bytes, now=time.time())
            if outcome == "tenant_queue_full":
                tenant_queue_full(
                    int(detail), ticket.priority, limit=tenant_depth, limits=self.limits, rate=ticket.rate
                )
            queue_full(int(detail), ticket.priority, limits=self.limits, rate=ticket.rate)
            raise AssertionError(f"admit script answered {outcome!r}")  # pragma: no cover
        except BaseException:
            if ticket.probe:  # the probe was not queued: let the next submit be it
                with contextlib.suppress(Exception):
                    await asyncio.shield(self.breaker.release_probe(ticket.model))
            raise
