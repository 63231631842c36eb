"""Stage 0's routes to the later stages' replicas (`app.workers.engine.routes`) over the real Redis,
and the step message's plan (`app.workers.engine.wire`) as it travels: the replicas picked are live
ones, kept while they beat, dropped when one stops, and those that lost plans are not picked again
while their heartbeats may still look live."""

from __future__ import annotations

import time

import msgpack

from app.workers.engine import routes as routes_module
from app.workers.engine.routes import Routes
from app.workers.engine.scheduler import Scheduler, SchedulerConfig, Seq
from app.workers.engine.wire import PlanWire, Sampled


def beat(redis, keys, stage: int, worker: str, at: float | None = None) -> None:  # type: ignore[no-untyped-def]
    redis.zadd(keys.workers("m", stage), {worker: time.time() if at is None else at})


def test_a_live_replica_of_each_later_stage_is_picked_and_kept_while_it_beats(redis, keys, monkeypatch):  # type: ignore[no-untyped-def]
    routes = Routes(redis, keys, "m", 3, "head-1", ttl_s=10.0)
    assert routes.check() is True and not routes.pick()  # no stage 1 or 2 replica yet
    beat(redis, keys, 1, "s1-a")
    beat(redis, keys, 1, "s1-old", at=time.time() - 60)  # its heartbeat lapsed
    assert not routes.pick()  # stage 2 still has none
    beat(redis, keys, 2, "s2-a")
    assert routes.pick()
    assert routes.workers == ["s1-a", "s2-a"]
    assert routes.lanes == [keys.lane("m", 1, "s1-a"), keys.lane("m", 2, "s2-a")]
    assert routes.check() is None  # checked just now
    monkeypatch.setattr(routes_module, "CHECK_S", 0.0)
    assert routes.check() is None  # both still beat
    redis.zrem(keys.workers("m", 2), "s2-a")  # stage 2's replica stopped
    assert routes.check() is False


def test_replicas_that_lost_plans_are_not_picked_again_while_they_may_look_live(redis, keys):  # type: ignore[no-untyped-def]
    beat(redis, keys, 1, "s1-a")
    routes = Routes(redis, keys, "m", 2, "head-1", ttl_s=10.0)
    assert routes.pick() and routes.workers == ["s1-a"]
    routes.drop(shun=True)
    assert routes.lanes == [] and not routes.pick()  # the only replica lost the plans: wait
    beat(redis, keys, 1, "s1-b")  # its replacement started
    assert routes.pick() and routes.workers == ["s1-b"]


def test_a_plan_and_its_outcome_survive_the_wire() -> None:
    scheduler = Scheduler(SchedulerConfig(num_blocks=8, block_size=4, max_num_seqs=4, max_in_flight=2))
    scheduler.add(Seq("a", (1, 2, 3, 4, 5), 3))
    scheduler.add(Seq("b", (6, 7), 3))
    plan = scheduler.schedule()
    sent = PlanWire(plan, "head-1", 1, 3, 8, new={"a": "batch-1"}, gone=("z",))
    got = PlanWire.from_wire(msgpack.unpackb(msgpack.packb(sent.to_wire()), raw=False))
    assert got.plan.rows == plan.rows and got.plan.decodes == plan.decodes and got.plan.step == plan.step
    assert (got.head, got.group, got.epoch, got.num_blocks, got.new, got.gone) == (
        "head-1",
        1,
        3,
        8,
        {"a": "batch-1"},
        ("z",),
    )
    outcome = Sampled(plan.step, 3, {"a": 9, "b": 10}, ("b",))
    assert Sampled.from_wire(msgpack.unpackb(msgpack.packb(outcome.to_wire()), raw=False)) == outcome
