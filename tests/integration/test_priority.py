"""Priority classes: with the pipeline full, urgent jobs that arrive last still start first."""

from __future__ import annotations

import time

from clients import events, submit, wait
from conftest import start_stack


def test_classes_drain_in_priority_order(tmp_path, redis_url, tiny_model):  # type: ignore[no-untyped-def]
    # One batch at a time, one job per batch, no joining: the order of dispatch is the order of service.
    stack = start_stack(
        tmp_path,
        redis_url=redis_url,
        models={"tiny": tiny_model},
        default_model="tiny",
        extra_env={
            "CONVEYOR_MAX_INFLIGHT_BATCHES": "1",
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
            time.sleep(0.1)
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
