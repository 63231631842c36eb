"""The batcher's in-flight budget against a real Redis and real heartbeats: it follows the live stage
replicas of each model, and each model's sequences count against its own budget only.

The batcher runs in process; what it hands the broker is recorded (no stage worker runs), and a
sequence "finishes" by leaving the progress set, as a stage worker's last token makes it leave.
"""

from __future__ import annotations

import time
import uuid

import pytest

from app.batching import intake
from app.batching.scheduler import Batcher
from app.core import credit
from app.core.config import Settings
from app.core.credit import ReplicaCredit
from app.core.keys import Keys
from app.core.protocol import StepMessage
from app.workers.heartbeat import Heartbeat

PER_REPLICA = 4  # max_running_sequences: one replica's share of sequences


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture()
def batcher(redis, redis_url, keys):  # type: ignore[no-untyped-def]
    settings = Settings(
        redis_url=redis_url,
        namespace=keys.namespace,
        stages=2,
        max_running_sequences=PER_REPLICA,
        max_batch_size=1,  # one job per batch: what was dispatched is easy to count
        max_wait_ms=0,
    )
    sent: list[StepMessage] = []
    clock = Clock()
    batcher = Batcher(
        settings.batcher,
        redis=redis,
        send=lambda message, _queue: sent.append(message),
        clock=clock,
        max_block_ms=10,  # `settle` ticks until nothing moves: no arrival is worth a second's wait
    )
    intake.ensure_groups(redis, keys)
    batcher.sent, batcher.fake_clock = sent, clock  # type: ignore[attr-defined]
    return batcher


def replica(redis, keys: Keys, model: str, stage: int) -> Heartbeat:  # type: ignore[no-untyped-def]
    """A stage replica's heartbeat, beating once (a live replica as the batcher sees it)."""
    heartbeat = Heartbeat(
        redis,
        keys.workers(model, stage),
        f"{model}-{stage}-{uuid.uuid4().hex[:6]}",
        interval_s=2.0,
        ttl_s=10.0,
        stats=lambda _device: None,
    )
    heartbeat.beat()
    return heartbeat


def submit(redis, keys: Keys, model: str, n: int) -> list[str]:  # type: ignore[no-untyped-def]
    """Queue `n` jobs of `model` as the api does: a queued record and an intake entry each."""
    job_ids = [uuid.uuid4().hex for _ in range(n)]
    for job_id in job_ids:
        redis.hset(keys.job(job_id), mapping={"id": job_id, "status": "queued", "model": model})
        fields = intake.intake_fields(job_id=job_id, model=model, prompt_tokens=3, priority="normal")
        redis.xadd(keys.intake("normal"), fields)  # type: ignore[arg-type]
    return job_ids


def settle(batcher) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """Let the batcher run until it dispatches nothing more; sequences dispatched so far, per model."""
    batcher.fake_clock.now += 2.0  # past the window, and past the census' refresh of live replicas
    quiet = 0
    while quiet < 2:  # two rounds in a row that dispatch nothing
        before = len(batcher.sent)
        batcher.tick()
        quiet = quiet + 1 if len(batcher.sent) == before else 0
    counts: dict[str, int] = {}
    for message in batcher.sent:
        counts[message.model] = counts.get(message.model, 0) + len(message.seq_ids)
    return counts


def finish(redis, keys: Keys, batcher, model: str, n: int) -> None:  # type: ignore[no-untyped-def]
    """`n` running sequences of `model` end (they leave the progress set)."""
    ended = [j for m in batcher.sent if m.model == model for j in m.seq_ids]
    done = [j for j in ended if redis.zscore(keys.progress(), j) is not None][:n]
    redis.zrem(keys.progress(), *done)


def test_the_budget_follows_the_live_replicas_of_the_thinnest_stage(redis, keys, batcher):  # type: ignore[no-untyped-def]
    beats = [replica(redis, keys, "a", 0), replica(redis, keys, "a", 1)]
    submit(redis, keys, "a", 20)
    assert settle(batcher) == {"a": PER_REPLICA}  # one replica per stage: one replica's share

    beats.append(replica(redis, keys, "a", 0))  # a second replica of stage 0 only: stage 1 bounds
    assert settle(batcher) == {"a": PER_REPLICA}
    beats.append(replica(redis, keys, "a", 1))  # and of stage 1: the budget doubles
    assert settle(batcher) == {"a": 2 * PER_REPLICA}
    assert redis.zcard(keys.progress()) == 2 * PER_REPLICA

    beats.pop().stop()  # a stage 1 replica leaves: back to one replica's share
    finish(redis, keys, batcher, "a", PER_REPLICA + 1)  # 3 still in flight, room for 1
    assert settle(batcher) == {"a": 2 * PER_REPLICA + 1}


def test_each_model_counts_its_own_sequences(redis, keys, batcher):  # type: ignore[no-untyped-def]
    for model in ("a", "b"):
        for stage in range(2):
            replica(redis, keys, model, stage)
    submit(redis, keys, "a", 10)
    assert settle(batcher) == {"a": PER_REPLICA}
    # Model a's pipeline is full; b's is empty and takes its own full share.
    submit(redis, keys, "b", 10)
    assert settle(batcher) == {"a": PER_REPLICA, "b": PER_REPLICA}
    finish(redis, keys, batcher, "b", 2)  # b's room is b's: a gets nothing more
    assert settle(batcher) == {"a": PER_REPLICA, "b": PER_REPLICA + 2}


def test_a_pipeline_whose_heartbeats_lapsed_keeps_one_replicas_budget(redis, keys, batcher):  # type: ignore[no-untyped-def]
    lapsed = time.time() - 60  # beyond heartbeat_ttl_s: not live
    for stage in range(2):
        redis.zadd(keys.workers("a", stage), {f"gone-{stage}": lapsed})
    submit(redis, keys, "a", 10)
    assert settle(batcher) == {"a": PER_REPLICA}


def test_the_monitor_finds_in_flight_batches_without_scanning_the_keyspace(redis, keys, batcher):  # type: ignore[no-untyped-def]
    """The in-flight hashes are found through the `inflightmodels` set: the monitor never scans."""
    scans: list[str] = []
    scan_iter = redis.scan_iter

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        scans.append(kwargs.get("match", ""))
        return scan_iter(*args, **kwargs)

    batcher.redis.scan_iter = counted
    for stage in range(2):
        replica(redis, keys, "a", stage)
    submit(redis, keys, "a", 2)
    settle(batcher)
    assert redis.smembers(keys.inflight_models()) == {b"a"}
    assert redis.hlen(keys.inflight("a")) == 2
    redis.zrem(keys.progress(), *[j for m in batcher.sent for j in m.seq_ids])  # every job ended
    for _ in range(3):
        batcher.recover()
    assert scans == []
    assert redis.hlen(keys.inflight("a")) == 0  # yet the finished batches were found and freed


def test_a_model_without_workers_holding_100_scheduled_jobs_does_not_stop_another(redis, keys, batcher):  # type: ignore[no-untyped-def]
    """Capacity is counted per model: 100 jobs of a model whose workers are all gone, scheduled and
    stuck (as a dispatch leaves them: a scheduled record and a progress score each), take nothing
    of another model's budget."""
    lapsed = time.time() - 60
    for stage in range(2):
        redis.zadd(keys.workers("dead", stage), {f"gone-{stage}": lapsed})
        replica(redis, keys, "a", stage)
    stuck = [uuid.uuid4().hex for _ in range(100)]
    for job_id in stuck:
        redis.hset(keys.job(job_id), mapping={"id": job_id, "status": "scheduled", "model": "dead"})
    redis.zadd(keys.progress(), dict.fromkeys(stuck, time.time()))
    submit(redis, keys, "a", 10)
    assert settle(batcher) == {"a": PER_REPLICA}  # a's whole budget, whatever "dead" holds


def test_a_job_cancelled_in_the_batchers_window_takes_no_seat(redis, keys, batcher):  # type: ignore[no-untyped-def]
    """A job the batcher has read (waiting in its window for room) and that is cancelled before its
    dispatch is skipped and leaves no progress score: its seat goes to the next job at once, not
    after the monitor's stall timeout (30 s by default)."""
    for stage in range(2):
        replica(redis, keys, "a", stage)
    submit(redis, keys, "a", PER_REPLICA)
    assert settle(batcher) == {"a": PER_REPLICA}  # the budget is full
    [cancelled] = submit(redis, keys, "a", 1)
    settle(batcher)  # read into the window, not dispatched: no room
    redis.hset(keys.job(cancelled), "status", "cancelled")  # cancelled while it waits there
    finish(redis, keys, batcher, "a", 1)  # a seat frees; the batcher takes the cancelled job to it
    assert settle(batcher) == {"a": PER_REPLICA}  # nothing sent for it
    assert redis.zscore(keys.progress(), cancelled) is None
    [after] = submit(redis, keys, "a", 1)
    assert settle(batcher) == {"a": PER_REPLICA + 1}  # the seat is free for the next job
    assert batcher.sent[-1].seq_ids == [after]


def advertise(redis, keys: Keys, beat: Heartbeat, sequences: int, blocks: int, received=()) -> None:  # type: ignore[no-untyped-def]
    """A step-engine replica's report, as its runtime publishes it."""
    offer = ReplicaCredit(sequences, blocks, block_size=16, max_sequences=8, received=tuple(received))
    credit.Advertiser(redis, keys, "s", beat.member, ttl_s=10.0)(offer)


def test_a_step_engine_pipeline_gets_what_its_replica_advertises_and_no_more(redis, keys, batcher):  # type: ignore[no-untyped-def]
    beat = replica(redis, keys, "s", 0)
    advertise(redis, keys, beat, sequences=3, blocks=100)
    submit(redis, keys, "s", 10)
    assert settle(batcher) == {"s": 3}  # its credit, not the replica share (PER_REPLICA)
    assert settle(batcher) == {"s": 3}  # what is on its way counts until the replica reports it
    received = [m.batch_id for m in batcher.sent]
    advertise(redis, keys, beat, sequences=0, blocks=97, received=received)  # it took them: full
    assert settle(batcher) == {"s": 3}
    advertise(redis, keys, beat, sequences=2, blocks=99, received=received)  # two sequences ended
    assert settle(batcher) == {"s": 5}
    advertise(redis, keys, beat, sequences=8, blocks=2, received=[m.batch_id for m in batcher.sent])
    assert settle(batcher) == {"s": 7}  # its KV blocks bound it too: a prompt and a token, a block each


def test_a_pipeline_with_a_live_replica_that_advertises_nothing_is_bounded_by_the_census(
    redis, keys, batcher
):  # type: ignore[no-untyped-def]
    step = replica(redis, keys, "s", 0)
    advertise(redis, keys, step, sequences=8, blocks=100)
    replica(redis, keys, "s", 0)  # a batch-engine replica beside it: no credit of its own
    for stage in (1,):
        replica(redis, keys, "s", stage)
    submit(redis, keys, "s", 20)
    assert settle(batcher) == {"s": PER_REPLICA}
    step.stop()  # a replica that stopped is not counted, whatever it last advertised
    assert credit.live_credits(redis, keys, ["s"], since=time.time() - 10) == {}


def test_a_replica_s_report_is_dropped_once_its_stage_forgets_it(redis, keys):  # type: ignore[no-untyped-def]
    """A worker killed before it could withdraw its report: the next tidy of a live replica's
    advertiser drops it once the stage's heartbeats have forgotten the worker."""
    killed, live = replica(redis, keys, "s", 0), replica(redis, keys, "s", 0)
    offer = ReplicaCredit(1, 1, block_size=16, max_sequences=1)
    credit.Advertiser(redis, keys, "s", killed.member, ttl_s=10.0)(offer)
    redis.zrem(keys.workers("s", 0), killed.member)  # forgotten (10 x heartbeat_ttl_s after its last beat)
    credit.Advertiser(redis, keys, "s", live.member, ttl_s=10.0)(offer)
    assert set(redis.hkeys(keys.credit("s"))) == {live.member.encode()}


class Counted:
    """A Redis client that counts the pipelines it hands out (one round trip each)."""

    def __init__(self, redis) -> None:  # type: ignore[no-untyped-def]
        self.redis, self.pipelines = redis, 0

    def pipeline(self, **kwargs):  # type: ignore[no-untyped-def]
        self.pipelines += 1
        return self.redis.pipeline(**kwargs)


def test_a_batch_engine_pipeline_s_rounds_read_no_credit_between_refreshes(redis, keys, batcher):  # type: ignore[no-untyped-def]
    """Which models are on the step engine is read once per refresh (LIVE_REFRESH_S); between two,
    a batch-engine model's dispatch rounds read no credit, and a step-engine model's credit is read
    at every round."""
    for stage in range(2):
        replica(redis, keys, "a", stage)
    census = batcher.census
    assert census.credits(["a"]) == {}  # read: "a" advertises nothing
    census.redis = counted = Counted(redis)
    assert census.credits(["a"]) == {} and counted.pipelines == 0
    step = replica(redis, keys, "s", 0)
    advertise(redis, keys, step, sequences=3, blocks=9)
    assert [c.sequences for c in census.credits(["a", "s"])["s"]] == [3]  # a model not seen yet: read
    assert counted.pipelines == 1
    assert census.credits(["a"]) == {} and counted.pipelines == 1
    advertise(redis, keys, step, sequences=2, blocks=9)
    assert [c.sequences for c in census.credits(["s"])["s"]] == [2] and counted.pipelines == 2
