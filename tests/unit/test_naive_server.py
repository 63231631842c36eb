"""The benchmark's naive server (bench/naive_server.py) on the tiny model, in process.

The suite compares Conveyor against it, so it must be as good as its design allows: one request at a
time, and each answer sent as soon as its generation ends, however many requests wait behind it.
"""

import asyncio
import sys
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
from fastapi import FastAPI

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/ is not an installed package

import pytest

from bench.naive_server import Engine, create_app  # noqa: E402

# bench/'s own tests: `make test-bench`, out of the default gate
pytestmark = pytest.mark.bench

WAITING = 64  # more than the 40 tokens of anyio's default thread pool


@asynccontextmanager
async def served(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the app, its lifespan (the model loaded) around it."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://naive") as client:
            yield client


def test_answers_leave_as_generations_end_with_more_waiting_than_the_thread_pool(tiny_model: Path) -> None:
    app = create_app(tiny_model)
    ended: list[float] = []  # when each generation returned
    running = 0
    most_at_once = 0
    guard = threading.Lock()
    generate = Engine.generate

    def counted(
        self: Engine, prompt_ids: list[int], max_tokens: int, ignore_eos: bool
    ) -> tuple[list[int], float]:
        nonlocal running, most_at_once
        with guard:
            running += 1
            most_at_once = max(most_at_once, running)
        try:
            return generate(self, prompt_ids, max_tokens, ignore_eos)
        finally:
            with guard:
                running -= 1
                ended.append(time.perf_counter())

    async def main() -> list[tuple[int, int]]:
        arrivals: list[tuple[int, int]] = []  # (answers received before this one, generations ended by then)
        async with served(app) as client:

            async def one(i: int) -> None:
                body = {"prompt": f"request {i}", "max_tokens": 4, "ignore_eos": True}
                answer = await client.post("/generate", json=body, timeout=120)
                assert answer.status_code == 200, answer.text
                assert answer.json()["completion_tokens"] == 4
                arrivals.append((len(arrivals), len(ended)))

            await asyncio.gather(*(one(i) for i in range(WAITING)))
        return arrivals

    Engine.generate = counted  # type: ignore[method-assign]
    try:
        arrivals = asyncio.run(main())
    finally:
        Engine.generate = generate  # type: ignore[method-assign]
    assert len(arrivals) == WAITING
    # The k-th answer arrives once k + 1 generations have ended, give or take the one running next.
    late = [(k, generations) for k, generations in arrivals if generations - (k + 1) > 2]
    assert not late, f"answers held back behind later generations: {late[:5]}"
    assert most_at_once == 1


def test_bad_requests_get_a_422(tiny_model: Path) -> None:
    app = create_app(tiny_model)

    async def main() -> list[int]:
        async with served(app) as client:
            bodies = [
                {"max_tokens": 4},  # neither prompt nor messages
                {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]},
                {"prompt": "hi", "max_tokens": 0},
            ]
            return [(await client.post("/generate", json=b)).status_code for b in bodies]

    assert asyncio.run(main()) == [422, 422, 422]
