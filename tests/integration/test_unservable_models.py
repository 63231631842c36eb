"""One model the stages cannot serve, next to a good one: the API starts, answers 422
`model_unsupported` with the reason for a job to the broken model (never queues it to wait for
workers that refused it), keeps serving the good one, and is ready without waiting for workers of
the broken ones."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import redis as redis_lib
from fastapi.testclient import TestClient
from unservable import bidirectional, falcon, headless, lfs_pointer

from app.api.app import create_app
from app.core.config import Settings
from app.core.keys import Keys
from tests.tinyapi import TEST_HOSTS

BROKEN = {
    "pointer": "git-lfs pointer",
    "reward": "no LM head",
    "embeddinggemma": "bidirectional attention",
    "falcon": "'falcon'",
}


def test_the_api_refuses_jobs_for_unservable_models_and_serves_the_others(
    tmp_path: Path, redis_url: str, tiny_model: Path
) -> None:
    models = {
        "tiny": tiny_model,
        "pointer": lfs_pointer(tmp_path / "pointer"),
        "reward": headless(tmp_path / "reward"),
        "embeddinggemma": bidirectional(tmp_path / "embeddinggemma"),
        "falcon": falcon(tmp_path / "falcon", tiny_model),
    }
    settings = Settings(
        redis_url=redis_url,
        namespace=f"test-{uuid.uuid4().hex[:8]}",
        home=tmp_path / "home",
        models={name: str(path) for name, path in models.items()},
        served_models=list(models),  # as `conveyor up --model tiny --model pointer ...` sets it
        default_model="tiny",
        embedding_stages=0,
        auth="none",
        allowed_hosts=TEST_HOSTS,
    )
    with TestClient(create_app(settings)) as client:  # starts: the pointer's size is not read as a header
        for name, reason in BROKEN.items():
            for _ in range(2):  # and again: still refused, never queued
                answer = client.post("/v1/jobs", json={"model": name, "prompt": "hi", "max_tokens": 2})
                assert answer.status_code == 422, answer.text
                error = answer.json()["error"]
                assert error["code"] == "model_unsupported" and reason in error["message"], error
        accepted = client.post("/v1/jobs", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert accepted.status_code == 202, accepted.text
        # Ready once the good model's stages have workers: the refused ones are not waited for.
        keys, live = Keys(settings.namespace), redis_lib.Redis.from_url(redis_url)
        for stage in range(settings.stages):
            live.zadd(keys.workers("tiny", stage), {f"w{stage}": time.time() + 60})
            live.expire(keys.workers("tiny", stage), 60)
        ready = client.get("/readyz")
        assert ready.status_code == 200, ready.text
        assert set(ready.json()["checks"]["unservable"]) == set(BROKEN)
