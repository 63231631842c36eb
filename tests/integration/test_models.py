"""Models as a stack serves them: `conveyor up --model A --model B` runs a pipeline per model,
/v1/models lists exactly the models with workers (and their kind), and a model without a chat
template refuses chat requests."""

from __future__ import annotations

import asyncio
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis.asyncio
from clients import submit, wait
from fastapi.testclient import TestClient
from harness import start_harness
from tiny import make_tiny_model

from app.api.app import create_app
from app.api.catalog import serving
from app.core.config import EMBEDDING_MODEL, Settings
from app.core.keys import Keys
from tests.tinyapi import TEST_HOSTS

PROMPTS = ["one two three", "the quick brown fox", "0 1 2 3 4 5", "hello hello"]


def test_two_models_in_one_stack_answer_concurrently_and_are_listed(tmp_path, redis_url, tiny_model):  # type: ignore[no-untyped-def]
    second = make_tiny_model(tmp_path / "tiny2", seed=1)
    unstarted = make_tiny_model(tmp_path / "tiny3", seed=2)
    stack = start_harness(
        tmp_path,
        redis_url=redis_url,
        models={"tiny": tiny_model, "tiny2": second, "tiny3": unstarted},
        default_model="tiny",
        extra_env={"CONVEYOR_TORCH_THREADS": "1"},
        args=("--model", "tiny", "--model", "tiny2"),
    )
    try:
        with stack.client() as client, ThreadPoolExecutor(2 * len(PROMPTS)) as pool:
            # readyz waits for every stage of both pipelines
            checks = client.get("/readyz").json()["checks"]
            assert set(checks["models"]) == {"tiny", "tiny2"}
            # workers for the models named, none for the one only configured
            served = {info["model"] for info in checks["stages"].values()}
            listed = client.get("/v1/models").json()["data"]
            # two generation models served: the `auto` route between them is listed after them
            kinds = [(m["id"], m["kind"]) for m in listed]
            assert kinds == [("tiny", "generation"), ("tiny2", "generation"), ("auto", "route")]
            assert client.get("/v1/models/tiny3").status_code == 404
            refused = client.post("/v1/jobs", json={"model": "tiny3", "prompt": "hi"})
            assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"

            def run(model: str, prompt: str) -> dict:  # type: ignore[type-arg]
                job = submit(client, model=model, prompt=prompt, max_tokens=8, temperature=0, ignore_eos=True)
                return wait(client, job["id"])

            work = [(model, prompt) for prompt in PROMPTS for model in ("tiny", "tiny2")]
            done = list(pool.map(lambda w: run(*w), work))
    finally:
        stack.stop()
    assert all(job["status"] == "succeeded" for job in done), done
    assert [job["model"] for job in done] == [model for model, _ in work]
    by_model = {m: [job["text"] for job in done if job["model"] == m] for m in ("tiny", "tiny2")}
    assert by_model["tiny"] != by_model["tiny2"], "two different models answered"
    assert served == {"tiny", "tiny2"}


def test_v1_models_without_up_lists_the_models_with_live_workers(tmp_path, redis_url, tiny_model):  # type: ignore[no-untyped-def]
    settings = Settings(
        redis_url=redis_url,
        namespace=f"test-{uuid.uuid4().hex[:8]}",
        home=tmp_path / "home",
        models={"tiny": tiny_model, "idle": tiny_model, "dead": tiny_model},
        stages=2,
    )
    keys = Keys(settings.namespace)

    async def scenario() -> dict[str, str]:
        client = redis.asyncio.Redis.from_url(redis_url)
        now = time.time()
        try:
            await client.zadd(keys.workers("tiny", 1), {"w1": now})  # any stage counts
            await client.zadd(keys.workers(EMBEDDING_MODEL, 0), {"e0": now})
            await client.zadd(keys.workers("dead", 0), {"w0": now - 10 * settings.heartbeat_ttl_s})
            for key in (keys.workers("tiny", 1), keys.workers(EMBEDDING_MODEL, 0), keys.workers("dead", 0)):
                await client.expire(key, 60)
            return await serving(settings, client)
        finally:
            await client.aclose()

    assert asyncio.run(scenario()) == {EMBEDDING_MODEL: "embedding", "tiny": "generation"}


@pytest.fixture()
def plain_model(tmp_path: Path) -> Path:
    """A tiny model whose tokenizer has no chat template, as a base model's has none."""
    path = make_tiny_model(tmp_path / "plain")
    (path / "chat_template.jinja").unlink(missing_ok=True)
    return path


def test_a_chat_request_to_a_model_without_a_chat_template_is_422(tmp_path, redis_url, plain_model):  # type: ignore[no-untyped-def]
    settings = Settings(
        redis_url=redis_url,
        namespace=f"test-{uuid.uuid4().hex[:8]}",
        home=tmp_path / "home",
        models={"plain": plain_model},
        default_model="plain",
        embedding_stages=0,
        auth="none",  # an open API: this test is about chat templates, not credentials
        allowed_hosts=TEST_HOSTS,
    )
    with TestClient(create_app(settings)) as client:
        messages = [{"role": "user", "content": "hi"}]
        for path in ("/v1/chat/completions", "/v1/jobs"):
            answer = client.post(path, json={"model": "plain", "messages": messages})
            assert answer.status_code == 422, answer.text
            error = answer.json()["error"]
            assert error["code"] == "invalid_request" and "no chat template" in error["message"]
