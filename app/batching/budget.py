"""How much work a model's pipeline may hold, from the stage replicas that are live now.

The batcher calls `Census.budgets` once per dispatch round. A pipeline is as wide as its thinnest
stage: a model whose stage 0 has three live replicas and stage 1 one finishes work at one replica's
pace, so its budget is the minimum over stages of the live replicas (their heartbeats,
`Keys.workers`) times one replica's share. Adding a replica raises the budget at its first
heartbeat; a replica that stops beating lowers it `heartbeat_ttl_s` later.

The floor is one replica per stage: a pipeline whose heartbeats all lapse for a moment (Redis slow,
a worker restarting) keeps one replica's budget, so the work it was given waits in its stage queue
for the worker to come back instead of the batcher stopping dead; jobs of a worker that is really
gone are recovered by the monitor (app/batching/recovery.py), whatever the budget.

Sequences in flight are counted per model from the progress set (`Keys.progress`, every job
scheduled or running, of every model): the batcher remembers the model of each job it dispatched
and looks up, once, the few it does not know (dispatched before a restart).

A pipeline on the step engine says itself what it may still take (`app.core.credit`): its replicas'
free sequences and KV blocks replace the replica share and the progress-set count as its room, less
what the batcher has sent that no replica has reported receiving yet (`Ledger`).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from app.core.credit import ReplicaCredit, live_credits, prompt_blocks
from app.core.jobs import text_of
from app.core.keys import Keys

MIN_REPLICAS = 1  # the floor: a pipeline with no live heartbeat still gets one replica's budget
# Batches in flight (being prefilled, or waiting in the stage queue) per live replica of a model's
# thinnest stage. A replica's four task threads hold four and 12 wait in the queue: 1.5x the
# autoscaler's target of 8 waiting per replica (deploy/k8s ScaledObjects), so a saturated stage
# shows KEDA a queue to scale on.
REPLICA_BATCHES = 16
LIVE_REFRESH_S = 1.0  # live replicas are read this often (heartbeats come every 2 s)


@dataclass(frozen=True)
class Share:
    """What one live replica (of the thinnest stage) adds to its pipeline's budget."""

    batches: int  # batches being prefilled or waiting in the stage queue
    sequences: int | None  # sequences scheduled or running; None: no bound (request-level batching)


@dataclass(frozen=True)
class Budget:
    """A pipeline's bounds now (`windows.plan`'s capacity and the room it leaves)."""

    replicas: int  # live replicas of the thinnest stage, at least MIN_REPLICAS
    batches: int
    sequences: int | None


def pipeline_replicas(live_per_stage: Sequence[int]) -> int:
    """The replicas a pipeline counts as: its thinnest stage's live replicas, at least the floor."""
    return max(MIN_REPLICAS, min(live_per_stage, default=0))


def budget(live_per_stage: Sequence[int], share: Share) -> Budget:
    """One pipeline's budget: `share` times its replicas."""
    replicas = pipeline_replicas(live_per_stage)
    stages = len(live_per_stage)
    # A pipeline of N stages keeps N batches circulating (one per stage), so never fewer slots.
    batches = replicas * max(share.batches, stages + 1)
    sequences = None if share.sequences is None else replicas * share.sequences
    return Budget(replicas=replicas, batches=batches, sequences=sequences)


class Census:
    """Live replicas per stage and sequences in flight, per model, read from Redis for the batcher."""

    def __init__(
        self,
        redis: Any,
        keys: Keys,
        *,
        stages: int | Callable[[str], int],
        heartbeat_ttl_s: float,
        clock: Callable[[], float],
    ) -> None:
        """`stages`: every model's stage count, or a model's (`BatcherSettings.stages_of`)."""
        self.redis = redis
        self.keys = keys
        self.stages_of = stages if callable(stages) else lambda _model: stages
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.clock = clock
        self.model_of: dict[str, str] = {}  # job id -> model, for the jobs in the progress set
        self._live: dict[str, tuple[float, list[int]]] = {}  # model -> (when read, live per stage)
        self._credited: set[str] = set()  # the models on the step engine when last read
        self._seen: set[str] = set()  # the models read then
        self._engines_read = -float("inf")

    def dispatched(self, model: str, job_ids: Iterable[str]) -> None:
        """The batcher scheduled these jobs of `model` (they are in the progress set now)."""
        self.model_of.update(dict.fromkeys(job_ids, model))

    def live(self, models: Iterable[str]) -> dict[str, list[int]]:
        """Live replicas of each stage of each model (re-read at most every LIVE_REFRESH_S)."""
        now = self.clock()
        stale = [m for m in models if m not in self._live or now - self._live[m][0] >= LIVE_REFRESH_S]
        if stale:
            since = time.time() - self.heartbeat_ttl_s
            pipe = self.redis.pipeline(transaction=False)
            for model in stale:
                for stage in range(self.stages_of(model)):
                    pipe.zcount(self.keys.workers(model, stage), since, "+inf")
            counts = iter(int(c) for c in pipe.execute())
            for model in stale:
                self._live[model] = (now, [next(counts) for _ in range(self.stages_of(model))])
        return {m: self._live[m][1] for m in models}

    def credits(self, models: Iterable[str]) -> dict[str, list[ReplicaCredit]]:
        """The live replicas' credit of each model served by the step engine (`app.core.credit`).
        Which models those are is read again every LIVE_REFRESH_S; in between, only theirs is read:
        a round of a batch-engine pipeline costs no Redis round trip for it."""
        models = set(models)
        now = self.clock()
        if now - self._engines_read >= LIVE_REFRESH_S or not models <= self._seen:
            self._engines_read, self._seen = now, models | self._seen
            found = live_credits(self.redis, self.keys, models, since=time.time() - self.heartbeat_ttl_s)
            self._credited = (self._credited - models) | set(found)
            return found
        if not models & self._credited:
            return {}
        return live_credits(
            self.redis, self.keys, models & self._credited, since=time.time() - self.heartbeat_ttl_s
        )

    def in_flight(self) -> Counter[str]:
        """Sequences scheduled or running, per model."""
        members = [text_of(m) for m in self.redis.zrange(self.keys.progress(), 0, -1)]
        unknown = [m for m in members if m not in self.model_of]
        if unknown:
            pipe = self.redis.pipeline(transaction=False)
            for job_id in unknown:
                pipe.hget(self.keys.job(job_id), "model")
            # An expired record counts under "" until the monitor drops it from the set.
            self.model_of.update(zip(unknown, (text_of(m) for m in pipe.execute()), strict=True))
        self.model_of = {m: self.model_of[m] for m in members}  # forget the jobs that ended
        return Counter(self.model_of.values())


@dataclass(frozen=True)
class Room:
    """What a step-engine pipeline may still take now: its replicas' credit, less what is on its way."""

    sequences: int
    blocks: int
    block_size: int
    max_sequences: int  # its replicas' sequence slots in all (the batch class's reserve is taken from it)


class Ledger:
    """Batches sent to step-engine pipelines that no replica has reported receiving yet.

    A batch leaves the ledger when a live replica's report names it (its jobs are in that replica's
    credit from then), or `horizon_s` after it was sent: a message that long on its way was lost with
    a worker, and the recovery monitor has its jobs.
    """

    def __init__(self, *, horizon_s: float) -> None:
        self.horizon_s = horizon_s
        self.on_the_way: dict[str, tuple[str, tuple[int, ...], float]] = {}  # batch -> (model, prompts, sent)

    def sent(self, model: str, batch_id: str, prompt_tokens: Iterable[int], now: float) -> None:
        self.on_the_way[batch_id] = (model, tuple(prompt_tokens), now)

    def room(self, model: str, credits: Sequence[ReplicaCredit], now: float) -> Room:
        """`model`'s room from its live replicas' `credits` (at least one)."""
        received = {b for c in credits for b in c.received}
        self.on_the_way = {
            b: sent
            for b, sent in self.on_the_way.items()
            if b not in received and now - sent[2] <= self.horizon_s
        }
        block_size = max(c.block_size for c in credits)
        prompts = [t for m, batch, _ in self.on_the_way.values() if m == model for t in batch]
        promised = sum(prompt_blocks(t, block_size) for t in prompts)
        return Room(
            sequences=max(0, sum(c.sequences for c in credits) - len(prompts)),
            blocks=max(0, sum(c.blocks for c in credits) - promised),
            block_size=block_size,
            max_sequences=sum(c.max_sequences for c in credits),
        )
