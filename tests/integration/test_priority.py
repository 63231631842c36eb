"""Priority classes: with the pipeline full, urgent jobs that arrive last still start first."""

from __future__ import annotations

import time

from clients import events, submit, wait
from harness import start_harness

from app.core.keys import BATCHER_GROUP, Keys


def test_classes_drain_in_priority_order(tmp_path, redis_url, redis, tiny_model):  # type: ignore[no-untyped-def]
    # One job at a time (one live replica's share of one sequence), one job per batch, no joining:
    # the order of dispatch is the order of service.
    stack = start_harness(
        tmp_path,
        redis_url=redis_url,
        models={"tiny": tiny_model},
        default_model="tiny",
        extra_env={
            "CONVEYOR_MAX_BATCH_SIZE": "1",
            "CONVEYOR_MAX_RUNNING_SEQUENCES": "1",
            "CONVEYOR_TORCH_THREADS": "1",
        },
    )
    try:
        with stack.client() as client:
            busy = submit(client, prompt="keep the pipeline busy", max_tokens=200, ignore_eos=True)
            events(client, busy["urls"]["events"], max_tokens=1)  # it is running
            body = {"prompt": "queued", "max_tokens": 2, "ignore_eos": True}
            low = [submit(client, priority="low", **body) for _ in range(2)]
            normal = submit(client, priority="normal", **body)
            # The batcher has read the three (they wait in its window, unacknowledged) before the
            # urgent ones arrive.
            keys, deadline = Keys(stack.namespace), time.monotonic() + 30
            while (
                sum(redis.xpending(keys.intake(p), BATCHER_GROUP)["pending"] for p in ("normal", "batch")) < 3
            ):
                assert time.monotonic() < deadline, "the batcher did not read the queued jobs"
                time.sleep(0.01)
            # The first urgent job starts at once on the reserve; the next waits for it, still
            # ahead of the normal and batch jobs that were queued before either arrived.
            realtime = submit(client, priority="realtime", **body)
            high = submit(client, priority="high", **body)
            named = [
                ("low0", low[0]),
                ("low1", low[1]),
                ("normal", normal),
                ("high", high),
                ("realtime", realtime),
            ]
            jobs = {name: wait(client, j["id"]) for name, j in named}
            assert wait(client, busy["id"])["status"] == "succeeded"
    finally:
        stack.stop()
    assert all(j["status"] == "succeeded" for j in jobs.values())
    order = sorted(jobs, key=lambda name: jobs[name]["timings"]["scheduled_at"])
    assert order == ["realtime", "high", "normal", "low0", "low1"]
    assert jobs["low0"]["priority"] == "batch"  # `low` is an alias of `batch`, stored as its class


def test_an_urgent_prefill_is_fetched_from_the_stage_queue_before_earlier_ones(redis_url, redis):  # type: ignore[no-untyped-def]
    # The stage worker fetches with BRPOP over the queue's priority lists in step order; a
    # basic_get walks them in the same order, so this is the order a stage worker runs them.
    import uuid

    from app.core.broker import create_celery_app
    from app.core.config import Settings
    from app.core.protocol import STEP_TASK, StepMessage, broker_priority

    namespace = f"test-{uuid.uuid4().hex[:8]}"
    app = create_celery_app(Settings(namespace=namespace), redis_url)
    queue = f"{namespace}.stage.m.0"
    sent = [("normal-1", 2), ("batch", 3), ("normal-2", 2), ("high", 1), ("realtime", 0)]
    for name, priority in sent:
        message = StepMessage(name, "m", 0, 1, "prefill", 0, ["job"], priority=priority)
        app.send_task(STEP_TASK, args=[message.to_wire()], queue=queue, priority=broker_priority(message))
    # What an autoscaler counts: one Redis list per priority step.
    assert [redis.llen(queue), redis.llen(f"{queue}:3"), redis.llen(f"{queue}:6")] == [2, 2, 1]
    fetched = []
    with app.connection_for_read() as connection:
        simple = connection.SimpleQueue(queue, no_ack=True, accept=["msgpack"])
        for _ in sent:
            body = simple.get(timeout=5).decode()
            fetched.append(body[0][0]["batch_id"])
        simple.close()
    assert fetched == ["high", "realtime", "normal-1", "normal-2", "batch"]
