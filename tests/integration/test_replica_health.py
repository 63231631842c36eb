"""Stage replica health on a real Redis and real Celery workers: an unhealthy replica is skipped, then
comes back.

Two replicas of one stage, each a process running `serve` (app/workers/celery_app.py) as a stage
worker does, with its heartbeat and health monitor, consume the stage's shared queue. The device
reports are injected (no GPU: each replica reads the report the test wrote for it), the only fake;
the handler records in Redis which replica ran each message, in place of the model.

Each replica is a spawned interpreter that imports this module for `replica_main`: the module
imports only what a stage worker imports at the top (conftest, with torch and transformers, and the
API's test client are imported where they are used), so a replica starts in a second, not ten.
"""

from __future__ import annotations

import json
import multiprocessing
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
import redis as redis_lib

from app.core.broker import create_celery_app
from app.core.config import Settings
from app.core.health import State, Thresholds
from app.core.keys import Keys
from app.core.protocol import STEP_TASK
from app.workers.celery_app import register_step_task, serve
from app.workers.health import HealthMonitor, gated

MODEL, STAGE = "tiny", 0
COOL = {"memory_used_mib": 1000.0, "memory_total_mib": 8000.0, "temperature_c": 60.0}
HOT = {**COOL, "temperature_c": 92.0}


def until(condition: Callable[[], Any], timeout_s: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or condition}")
        time.sleep(0.05)


def replica_main(settings: Settings, name: str, metrics_port: int) -> None:
    """One stage replica (a child process): the stage worker's wiring, a handler that records."""
    keys = Keys(settings.namespace)
    queue = keys.stage_queue(MODEL, STAGE)
    url = settings.redis_url or ""
    redis = redis_lib.Redis.from_url(url)
    app = create_celery_app(settings, url)
    monitor = HealthMonitor(
        redis,
        keys,
        model=MODEL,
        stage=STAGE,
        worker=name,
        queue=queue,
        thresholds=Thresholds(cooldown_s=0.3, fresh_s=settings.heartbeat_ttl_s),
    )

    def run(wire: dict[str, Any]) -> None:
        redis.rpush(f"{settings.namespace}:test:ran:{name}", wire["batch_id"])

    def requeue(wire: dict[str, Any]) -> None:
        app.send_task(STEP_TASK, args=[wire], queue=queue)

    def report(_device: str) -> dict[str, Any]:
        return {
            **json.loads(redis.get(f"{settings.namespace}:test:report:{name}") or "{}"),
            "at": time.time(),
        }

    register_step_task(app, gated(monitor, run, requeue))
    serve(
        app,
        settings.model_copy(update={"metrics_port": metrics_port}),
        redis=redis,
        heartbeat_key=keys.workers(MODEL, STAGE),
        worker=name,
        hostname=f"{name}-{settings.namespace}",
        queues=[queue],
        device="cuda:0",
        labels=(MODEL, str(STAGE)),
        slots=2,
        health=monitor,
        device_stats=report,
        loglevel="WARNING",
    )


class Replica:
    def __init__(self, settings: Settings, redis: redis_lib.Redis, name: str) -> None:
        from conftest import free_port

        self.settings, self.redis, self.name = settings, redis, name
        self.metrics_port = free_port()
        self.report(COOL)
        context = multiprocessing.get_context("spawn")
        self.process = context.Process(target=replica_main, args=(settings, name, self.metrics_port))

    def report(self, stats: dict[str, Any]) -> None:
        """What this replica's device reports from its next heartbeat on."""
        self.redis.set(f"{self.settings.namespace}:test:report:{self.name}", json.dumps(stats))

    def ran(self) -> list[str]:
        return [
            x.decode() for x in self.redis.lrange(f"{self.settings.namespace}:test:ran:{self.name}", 0, -1)
        ]

    def health(self) -> dict[str, Any]:
        raw = self.redis.hget(Keys(self.settings.namespace).health(), self.name)
        return json.loads(raw) if raw else {}

    def state(self) -> str | None:
        return self.health().get("state")

    def metric(self) -> str:
        return httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text


@pytest.fixture()
def settings(redis_url: str) -> Settings:
    return Settings(
        namespace=f"test-health-{uuid.uuid4().hex[:8]}",
        redis_url=redis_url,
        flower_port=0,
        heartbeat_ttl_s=1.0,  # a beat every 0.2 s
    )


@contextmanager
def replicas(settings: Settings, names: list[str]) -> Iterator[dict[str, Replica]]:
    redis = redis_lib.Redis.from_url(settings.redis_url or "")
    out = {name: Replica(settings, redis, name) for name in names}
    try:
        for replica in out.values():
            replica.process.start()
        # Both consume: a few messages run, whoever takes them.
        warm = send(settings, 4)
        until(
            lambda: sorted(x for r in out.values() for x in r.ran()) == sorted(warm), 120, "both replicas up"
        )
        redis.delete(*[f"{settings.namespace}:test:ran:{n}" for n in names])
        yield out
    finally:
        for replica in out.values():
            replica.process.terminate()  # SIGTERM: Celery's warm shutdown, as in a deployment
        for replica in out.values():
            replica.process.join(30)
            if replica.process.is_alive():
                replica.process.kill()
        keys = redis.keys(f"{settings.namespace}*")
        if keys:
            redis.delete(*keys)


def send(settings: Settings, count: int) -> list[str]:
    app = create_celery_app(settings, settings.redis_url or "")
    queue = Keys(settings.namespace).stage_queue(MODEL, STAGE)
    ids = [uuid.uuid4().hex for _ in range(count)]
    for batch_id in ids:
        app.send_task(STEP_TASK, args=[{"batch_id": batch_id}], queue=queue)
    app.close()
    return ids


def test_an_unhealthy_replica_takes_no_new_batches_until_its_probe_passes(settings: Settings) -> None:
    from starlette.testclient import TestClient

    with replicas(settings, ["a", "b"]) as r:
        a, b = r["a"], r["b"]
        a.report(HOT)  # from its next beat on, a's device is at 92 C
        until(lambda: a.state() == State.UNHEALTHY, what="a unhealthy")
        assert (
            'conveyor_stage_unhealthy{model="tiny",reason="temperature",stage="0",worker="a"} 1.0'
            in a.metric()
        )
        with TestClient(_api(settings)) as api:
            sick = api.get("/readyz").json()["checks"]["health"]["not_healthy"]
        assert set(sick) == {"a"} and sick["a"]["reason"] == "temperature" and sick["a"]["stage"] == STAGE
        assert sick["a"]["detail"] == "device at 92 C, over 85 C"

        ids = send(settings, 20)
        until(lambda: sorted(b.ran()) == sorted(ids), what="b runs every new batch")
        assert a.ran() == []

        # Cooled down: after the cool-down (0.3 s here) a fresh report passes, and it takes batches again.
        a.report(COOL)
        until(lambda: a.state() == State.HEALTHY, what="a's probe, then healthy")
        assert "conveyor_stage_unhealthy{" not in a.metric()

        # Now b's device memory fills: every new batch goes to a.
        b.report({**COOL, "memory_used_mib": 7900.0})
        until(lambda: b.state() == State.UNHEALTHY, what="b unhealthy")
        assert b.health()["detail"] == "device memory 98.8% in use, over 95%"
        more = send(settings, 10)
        until(lambda: sorted(a.ran()) == sorted(more), what="a runs every new batch")
        assert sorted(b.ran()) == sorted(ids)


def test_a_message_fetched_by_a_replica_that_turns_unhealthy_is_handed_on(redis_url: str) -> None:
    """What it had fetched goes back to the queue for another replica, and the thread holds its fetch
    slot while it is unhealthy; with no other replica to take it, it runs here. (The monitor's
    decisions come from real records in Redis; no Celery worker needed.)"""
    redis = redis_lib.Redis.from_url(redis_url)
    keys = Keys(f"test-health-{uuid.uuid4().hex[:8]}")
    limits = Thresholds(cooldown_s=0.2, fresh_s=10.0)
    monitors = {
        n: HealthMonitor(redis, keys, model=MODEL, stage=STAGE, worker=n, queue="q", thresholds=limits)
        for n in ("a", "b")
    }
    from app.core.health import Report

    def beat(name: str, temperature: float) -> None:
        redis.zadd(keys.workers(MODEL, STAGE), {name: time.time()})
        monitors[name].observe(Report(at=time.time(), redis_rtt_ms=1.0, temperature_c=temperature))

    try:
        beat("a", 60.0)
        beat("b", 60.0)
        ran: dict[str, list[str]] = {"a": [], "b": []}
        handler = gated(
            monitors["a"], lambda w: ran["a"].append(w["batch_id"]), lambda w: ran["b"].append(w["batch_id"])
        )
        beat("a", 95.0)
        holder = threading.Thread(target=handler, args=({"batch_id": "fetched-before"},))
        holder.start()
        until(lambda: ran["b"] == ["fetched-before"], what="handed on to b")
        assert holder.is_alive() and ran["a"] == [] and monitors["a"].handed_on == 1
        beat("b", 95.0)  # no other replica takes new batches now: the held thread returns
        holder.join(10)
        assert not holder.is_alive()
        handler({"batch_id": "nobody-else"})
        assert ran["a"] == ["nobody-else"]
    finally:
        redis.delete(keys.workers(MODEL, STAGE), keys.health())


def _api(settings: Settings) -> Any:
    """An open API whose callers see all of /readyz (which replicas are unhealthy, and why)."""
    from app.api.app import create_app

    return create_app(settings.model_copy(update={"auth": "none", "admin_tenants": ["anonymous"]}))
