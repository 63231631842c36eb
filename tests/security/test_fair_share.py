"""Fair share across tenants, on a stack started with two tenants' API keys (the tiny model).

The pipeline holds 4 sequences at once (its one live replica's MAX_RUNNING_SEQUENCES), so whatever is
queued beyond them waits and the batcher chooses, at every free seat, whose job goes next.

- a lone tenant gets the whole pipeline: every token;
- two tenants both backlogged, one of which queued nearly 7x the other's jobs (and queued them
  first): each gets 50% +- 10% of the tokens generated over the window. The window opens once both
  have queued (400 and 60 jobs of 8 tokens) and lasts until 400 tokens (50 jobs) have been
  generated, about 15 s on the tiny model; the light tenant still has jobs waiting at its end, so
  both were backlogged throughout (its jobs run while it is still queuing the rest: 60 leaves room
  for that). In arrival order the light tenant would get nothing in it;
- priority entitlements: a tenant may submit only to the classes `CONVEYOR_TENANT_PRIORITIES` lists
  for it (403 priority_not_allowed otherwise); others keep every class but realtime.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import redis as redis_lib
from harness import Harness, start_harness

from app.api.auth import key_digest, new_api_key
from app.core.keys import Keys

HEAVY, LIGHT = new_api_key(), new_api_key()
JOB = {"prompt": "x", "max_tokens": 8, "ignore_eos": True, "temperature": 0}
WINDOW_TOKENS = 400


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory, redis_url: str, tiny_model: Path) -> Iterator[Harness]:
    stack = start_harness(
        tmp_path_factory.mktemp("fair"),
        redis_url=redis_url,
        models={"tiny": tiny_model},
        default_model="tiny",
        extra_env={
            "CONVEYOR_TORCH_THREADS": "1",
            "CONVEYOR_API_KEYS": json.dumps({key_digest(HEAVY): "heavy", key_digest(LIGHT): "light"}),
            "CONVEYOR_RATE_LIMIT_RPS": "0",  # the tenants' pace is not what is tested
            "CONVEYOR_MAX_BATCH_SIZE": "4",
            "CONVEYOR_MAX_RUNNING_SEQUENCES": "4",  # one replica's share of sequences: the pipeline's
            "CONVEYOR_TENANT_PRIORITIES": json.dumps({"light": ["normal", "batch"]}),
        },
    )
    yield stack
    stack.stop()


def client(stack: Harness, key: str) -> httpx.Client:
    return stack.client(headers={"Authorization": f"Bearer {key}"})


def submit_many(stack: Harness, key: str, n: int) -> list[str]:
    with client(stack, key) as c, ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: c.post("/v1/jobs", json=JOB), range(n)))
    assert all(a.status_code == 202 for a in answers), {a.status_code for a in answers}
    return [a.json()["id"] for a in answers]


def tokens(redis: redis_lib.Redis, keys: Keys, jobs: dict[str, list[str]]) -> dict[str, int]:
    """Tokens generated so far per tenant, read in one round trip (one instant)."""
    pipe = redis.pipeline(transaction=True)
    for ids in jobs.values():
        for job_id in ids:
            pipe.hget(keys.job(job_id), "completion_tokens")
    counts = iter(pipe.execute())
    return {tenant: sum(int(next(counts) or 0) for _ in ids) for tenant, ids in jobs.items()}


def wait_for_tokens(
    redis: redis_lib.Redis, keys: Keys, jobs: dict[str, list[str]], at_least: int
) -> dict[str, int]:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        seen = tokens(redis, keys, jobs)
        if sum(seen.values()) >= at_least:
            return seen
        time.sleep(0.1)
    raise AssertionError(f"fewer than {at_least} tokens in 180 s: {seen}")


def drain(stack: Harness, key: str, ids: list[str]) -> None:
    with client(stack, key) as c:
        for job_id in ids:
            c.post(f"/v1/jobs/{job_id}/cancel")


def test_a_lone_tenant_gets_the_whole_pipeline(shared: Harness, redis: redis_lib.Redis) -> None:
    keys = Keys(shared.namespace)
    jobs = {"heavy": submit_many(shared, HEAVY, 24), "light": []}
    assert wait_for_tokens(redis, keys, jobs, 24 * 8) == {"heavy": 24 * 8, "light": 0}


def test_two_backlogged_tenants_each_get_half_whatever_their_backlogs(
    shared: Harness, redis: redis_lib.Redis
) -> None:
    keys = Keys(shared.namespace)
    heavy = submit_many(shared, HEAVY, 400)  # first, and nearly seven times as many
    light = submit_many(shared, LIGHT, 60)
    jobs = {"heavy": heavy, "light": light}
    try:
        start = tokens(redis, keys, jobs)  # the window opens once both are queued
        end = wait_for_tokens(redis, keys, jobs, sum(start.values()) + WINDOW_TOKENS)
        seen = {tenant: end[tenant] - start[tenant] for tenant in jobs}
        still_waiting = sum(
            int(t or 0) == 0 for t in [redis.hget(keys.job(j), "completion_tokens") for j in light]
        )
    finally:
        drain(shared, HEAVY, heavy)
        drain(shared, LIGHT, light)
    share = seen["light"] / sum(seen.values())
    print(f"\nover {sum(seen.values())} tokens: heavy {seen['heavy']}, light {seen['light']} ({share:.0%})")
    assert 0.4 <= share <= 0.6, seen
    assert still_waiting > 0, "the light tenant ran out of work: the window was not contended throughout"


def test_a_tenant_submits_only_to_the_classes_it_is_entitled_to(shared: Harness) -> None:
    with client(shared, LIGHT) as light, client(shared, HEAVY) as heavy:
        refused = light.post("/v1/jobs", json={**JOB, "priority": "realtime"})
        assert refused.status_code == 403, refused.text
        error = refused.json()["error"]
        assert error["code"] == "priority_not_allowed"
        assert error["details"]["allowed"] == ["normal", "batch"]
        assert light.post("/v1/jobs", json={**JOB, "priority": "low"}).status_code == 202  # batch's alias
        assert heavy.post("/v1/jobs", json={**JOB, "priority": "high"}).status_code == 202  # unlisted
        assert heavy.post("/v1/jobs", json={**JOB, "priority": "realtime"}).status_code == 403  # by name only
        openai = light.post(
            "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1, "priority": "high"}
        )
        assert openai.status_code == 403, openai.text
        assert openai.json()["error"]["code"] == "priority_not_allowed"
