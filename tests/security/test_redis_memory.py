"""Redis memory is bounded: a flood that is within every limit must not fill Redis, and a Redis
that is full must refuse work with a 503 a client can retry, never a 500.

Each test runs its own embedded Redis (as `conveyor up` starts it, `maxmemory` included), so that
`INFO memory` counts this test's keys alone, and the real API in process over it.

- 500 jobs with 8,000-token prompts submitted and cancelled: Redis grows by a bounded amount
  per job (the ended records keep no prompt), far under what the prompts weigh; a live job keeps
  its prompt and its day, an ended one loses the prompt and lives ended_job_ttl_s, stream included;
- a Redis at its maxmemory: submits (native and OpenAI) are 503 store_full with Retry-After, reads
  still answer, and writes resume once there is room;
- the embedded server `conveyor up` starts is bounded (CONVEYOR_EMBEDDED_REDIS_MAXMEMORY, 1 GB).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import redis as redis_lib
from conftest import free_port
from fastapi.testclient import TestClient
from tiny import make_tiny_model

from app.api.app import create_app
from app.core import admission
from app.core.config import Settings
from app.core.keys import Keys
from app.core.redis import start_embedded
from tests.tinyapi import TEST_HOSTS

# Enough jobs to weigh each one's share: 500, 2,000 and 10,000 measured the same per job (6.4-6.6 KB).
JOBS = 500
PROMPT_TOKENS = 8_000  # the tiny tokenizer is byte-level: one character, one token
# What the flood may add to Redis, whatever the prompts weigh: 10 KB a job. Measured: ~6.4 KB (its
# ended record ~1.4 KB; its one-event stream ~4.7 KB, as Redis allocates a stream's first node
# whole; its intake entry and two audit entries). The prompts alone are 500 x ~40 KB of token
# ids: 20 MB, where the record kept them a day.
BOUND_BYTES = JOBS * 10 * 1024


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny8k", context=8192)


@contextmanager
def own_redis(tmp: Path, maxmemory: str) -> Iterator[str]:
    """An embedded Redis of this test's own, bounded at `maxmemory` (set after its start, so that
    the bound is the test's whatever the server's default)."""
    process, url = start_embedded(tmp, free_port(), password=secrets.token_hex(16))
    try:
        redis_lib.Redis.from_url(url).config_set("maxmemory", maxmemory)
        yield url
    finally:
        process.terminate()
        process.wait(10)


def settings(url: str, model: Path, **overrides: object) -> Settings:
    values: dict[str, object] = {
        "redis_url": url,
        "namespace": f"test-{uuid.uuid4().hex[:8]}",
        "models": {"tiny": model},
        "default_model": "tiny",
        "embedding_stages": 0,
        "auth": "none",
        # No workers here: the stage gate would refuse after its grace (2 x heartbeat_ttl_s); no
        # batcher: the intake holds every cancelled job's entry (what the batcher would delete), so
        # the queue limits are raised.
        "heartbeat_ttl_s": 5e8,
        "queue_depth_limit": 2 * JOBS,  # and 4 x JOBS over every class
        "allowed_hosts": [*TEST_HOSTS, "api"],  # the flood's client calls it `api`
        **overrides,
    }
    return Settings(**values)  # type: ignore[arg-type]


def used_memory(client: redis_lib.Redis) -> int:
    return int(client.info("memory")["used_memory"])


async def flood(config: Settings, prompt: str) -> tuple[list[int], list[int]]:
    """Submit and at once cancel JOBS jobs, 32 at a time; the status codes of both."""
    app = create_app(config)
    submitted: list[int] = []
    cancelled: list[int] = []
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api", timeout=60) as client:
            queue: asyncio.Queue[int] = asyncio.Queue()
            for n in range(JOBS):
                queue.put_nowait(n)

            async def one_by_one() -> None:
                while not queue.empty():
                    queue.get_nowait()
                    answer = await client.post("/v1/jobs", json={"prompt": prompt, "max_tokens": 16})
                    submitted.append(answer.status_code)
                    if answer.status_code == 202:
                        job = answer.json()
                        cancelled.append((await client.post(f"/v1/jobs/{job['id']}/cancel")).status_code)

            await asyncio.gather(*(one_by_one() for _ in range(32)))
    return submitted, cancelled


@pytest.mark.slow
def test_a_submit_and_cancel_flood_of_long_prompts_leaves_redis_bounded(tmp_path, long_context_model):  # type: ignore[no-untyped-def]
    with own_redis(tmp_path / "redis", "2gb") as url:
        client = redis_lib.Redis.from_url(url)
        config = settings(url, long_context_model, rate_limit_rps=0)  # the flood's pace is not the point
        before = used_memory(client)
        submitted, cancelled = asyncio.run(flood(config, "a" * PROMPT_TOKENS))
        grown = used_memory(client) - before
        assert submitted.count(202) == JOBS and cancelled.count(200) == JOBS, (
            set(submitted),
            set(cancelled),
        )
        assert grown < BOUND_BYTES, f"Redis grew by {grown / 2**20:.1f} MiB for {JOBS} jobs"
        print(f"\nRedis grew by {grown / 2**20:.1f} MiB for {JOBS} submitted and cancelled jobs")
        check_lifetimes(config, client)


def check_lifetimes(config: Settings, client: redis_lib.Redis) -> None:
    """A live job keeps its prompt and its day; an ended one keeps neither, nor does its stream."""
    keys = Keys(config.namespace)
    with TestClient(create_app(config)) as api:
        live = api.post("/v1/jobs", json={"prompt": "a" * 100, "max_tokens": 4}).json()["id"]
        ended = api.post("/v1/jobs", json={"prompt": "a" * 100, "max_tokens": 4}).json()["id"]
        assert api.post(f"/v1/jobs/{ended}/cancel").status_code == 200
        assert api.get(f"/v1/jobs/{ended}").json()["status"] == "cancelled"  # still readable
    assert len(json.loads(client.hget(keys.job(live), "prompt_ids") or b"[]")) == 100
    assert client.ttl(keys.job(live)) > config.ended_job_ttl_s
    assert client.hget(keys.job(ended), "prompt_ids") is None
    assert 0 < client.ttl(keys.job(ended)) <= config.ended_job_ttl_s
    assert 0 < client.ttl(keys.events(ended)) <= config.ended_job_ttl_s


def test_a_full_redis_answers_503_with_retry_after_and_recovers(tmp_path, tiny_model):  # type: ignore[no-untyped-def]
    with own_redis(tmp_path / "redis", "16mb") as url:
        client = redis_lib.Redis.from_url(url)
        config = settings(url, tiny_model)
        with TestClient(create_app(config)) as api:
            job = api.post("/v1/jobs", json={"prompt": "before", "max_tokens": 2})
            assert job.status_code == 202, job.text
            filler = fill(client)  # Redis at its bound, as a flood would leave it
            # and held there: what Redis frees on its own (the filling client's query buffer) would
            # give a submit room again, and a job queued with no worker, `/v1/completions` waits on.
            client.config_set("maxmemory", used_memory(client) - 2**20)

            for path, body in [
                ("/v1/jobs", {"prompt": "hello", "max_tokens": 2}),
                ("/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 2}),
                (f"/v1/jobs/{job.json()['id']}/cancel", None),
            ]:
                refused = api.post(path, json=body)
                assert refused.status_code == 503, (path, refused.status_code, refused.text)
                assert refused.json()["error"]["code"] == "store_full", refused.text
                assert int(refused.headers["Retry-After"]) >= 1
            # reads go on: the job is there, still queued
            assert api.get(f"/v1/jobs/{job.json()['id']}").json()["status"] == "queued"

            for n in range(0, len(filler), 1000):  # room again (as ended jobs expire)
                client.delete(*filler[n : n + 1000])
            client.config_set("maxmemory", "16mb")
            assert api.post("/v1/jobs", json={"prompt": "after", "max_tokens": 2}).status_code == 202


def test_once_redis_refuses_a_write_the_next_submit_reads_its_memory_again(tmp_path, tiny_model, monkeypatch):  # type: ignore[no-untyped-def]
    """Gate 0 reads INFO memory at most every MEMORY_READ_S while under the high-water mark. Once
    Redis has refused a write at its bound, the next submit reads it again: the little room Redis
    frees on its own (a client's buffer) is under the mark, no room for new jobs. (Before: the
    reading from before the bound passed the submit, and a `/v1/completions` request waited on a
    job queued into a full store.)"""
    monkeypatch.setattr(admission, "MEMORY_READ_S", 3600.0)  # the first reading would stand
    with own_redis(tmp_path / "redis", "16mb") as url:
        client = redis_lib.Redis.from_url(url)
        with TestClient(create_app(settings(url, tiny_model))) as api:
            assert api.post("/v1/jobs", json={"prompt": "before", "max_tokens": 2}).status_code == 202
            filler = fill(client)
            # held past its bound for one submit: what Redis frees on its own meanwhile (the filling
            # client's query buffer) would let that submit's writes in
            client.config_set("maxmemory", used_memory(client) - 2**20)
            refused = api.post("/v1/jobs", json={"prompt": "full", "max_tokens": 2})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "store_full"
            client.config_set("maxmemory", "16mb")
            client.delete(*filler[:3])  # ~192 KB of room: still past 90% of maxmemory
            again = api.post("/v1/jobs", json={"prompt": "a little room", "max_tokens": 2})
            assert again.status_code == 503, again.text
            error = again.json()["error"]
            assert error["code"] == "store_full" and error["details"]["used_memory"] >= 0.9 * 16 * 2**20


def fill(client: redis_lib.Redis) -> list[str]:
    """Write until Redis refuses even a small write (a large one is refused sooner: its request
    buffer counts too); the keys written."""
    written: list[str] = []
    for size in (64 * 1024, 1024, 64):
        while len(written) < 100_000:
            key = f"filler:{len(written)}"
            try:
                client.set(key, b"x" * size)
            except redis_lib.exceptions.OutOfMemoryError:
                break
            written.append(key)
    assert len(written) < 100_000, "Redis never reached its maxmemory"
    return written


def test_the_embedded_server_is_bounded_and_never_evicts(tmp_path):  # type: ignore[no-untyped-def]
    maxmemory = Settings().embedded_redis_maxmemory
    assert maxmemory == "1gb"
    process, url = start_embedded(
        tmp_path / "redis", free_port(), password=secrets.token_hex(16), maxmemory=maxmemory
    )
    try:
        config = redis_lib.Redis.from_url(url, decode_responses=True).config_get("maxmemory*")
        assert config["maxmemory"] == str(2**30) and config["maxmemory-policy"] == "noeviction"
    finally:
        process.terminate()
        process.wait(10)
