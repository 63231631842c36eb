"""Work before the rate limit: huge prompts must neither stall the API's event loop nor be worked on
before the tenant pays for them.

- on the shared stack (uvicorn, the tiny model): /healthz stays fast while 1 MB prompts pour in;
- in process (the real app over a real Redis): a tenant with no requests left gets 429 for a 1 MB
  prompt (charged first, nothing tokenized), and a prompt longer than the context could hold is 422
  before it is tokenized.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from app.api.app import create_app
from tests.tinyapi import tiny_settings

HUGE = "word " * 200_000  # 1 MB


def test_healthz_stays_fast_while_megabyte_prompts_arrive(stack):  # type: ignore[no-untyped-def]
    stop = threading.Event()
    answered: list[int] = []

    def flood() -> None:
        with httpx.Client(base_url=stack.url, timeout=60.0) as client:
            while not stop.is_set():
                answered.append(client.post("/v1/jobs", json={"prompt": HUGE, "max_tokens": 1}).status_code)

    floods = [threading.Thread(target=flood) for _ in range(4)]
    for thread in floods:
        thread.start()
    try:
        with httpx.Client(base_url=stack.url, timeout=10.0) as client:
            deadline = time.monotonic() + 30
            while len(answered) < 4 and time.monotonic() < deadline:  # the flood is under way
                client.get("/healthz")
            took = []
            for _ in range(15):
                started = time.perf_counter()
                assert client.get("/healthz").status_code == 200
                took.append(time.perf_counter() - started)
    finally:
        stop.set()
        for thread in floods:
            thread.join()
    assert answered and set(answered) <= {413, 422, 429}, set(answered)
    assert statistics.median(took) < 0.050, [f"{t * 1000:.0f} ms" for t in took]


@contextmanager
def api(redis_url: str, tiny_model: Path, **settings: object) -> Iterator[TestClient]:
    config = tiny_settings(redis_url, tiny_model, auth="none", **settings)
    with TestClient(create_app(config)) as client:
        yield client


def test_the_rate_limit_is_charged_before_the_prompt_is_read(redis_url, tiny_model):  # type: ignore[no-untyped-def]
    with api(redis_url, tiny_model, rate_limit_rps=0.001) as client:  # a burst of one
        first = client.post("/v1/jobs", json={"prompt": HUGE, "max_tokens": 1})
        assert first.status_code == 422  # the one request the burst allows: read, and refused
        second = client.post("/v1/jobs", json={"prompt": HUGE, "max_tokens": 1})
        assert second.status_code == 429, second.text
        assert second.json()["error"]["code"] == "rate_limited"


@pytest.mark.parametrize("shape", ["prompt", "messages"])
def test_a_prompt_longer_than_any_context_is_refused_unread(redis_url, tiny_model, shape):  # type: ignore[no-untyped-def]
    text = "x" * (512 * 16 + 1)  # the tiny model's context is 512 tokens; 16 characters a token at most
    body = {"prompt": text} if shape == "prompt" else {"messages": [{"role": "user", "content": text}]}
    with api(redis_url, tiny_model) as client:
        answer = client.post("/v1/jobs", json={**body, "max_tokens": 1})
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["details"]["prompt_chars"] == len(text) and error["details"]["max_prompt_chars"] == 512 * 16
