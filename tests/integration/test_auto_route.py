"""Adaptive routing through a whole stack (`conveyor up --model tiny --model big`): `model: "auto"` is
resolved at admission to one of the two served models (app/core/routing.py), the job, its 202 and the
OpenAI answers name the model that served it, `conveyor_routes_total` counts the choices, and
/v1/models lists `auto` with its policy.

Two tiny random Llamas (SmolLM2's architecture, tests/tiny.py) stand for the small and the large
model: `big` has more layers, so more parameters, and `auto` picks it as the large one by itself. The
stack first runs without big's worker (a pipeline down: everything falls back to tiny), then big's
worker is started beside it, as a second host would.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from clients import submit, wait
from conftest import Stack, start_stack
from tiny import make_tiny_model

# hosts of one stack started with `--only`, one taken down
pytestmark = pytest.mark.e2e

ROUTES = {"auto": {"max_prompt_chars": 100}, "quick": {"small": "tiny", "large": "big", "max_tokens": 4}}
SHORT = "What is the capital of France?"
LONG = "Tell me about the sea and the ships on it. " * 4  # 172 characters, plain
COMPLEX = "Explain step by step why the sum of two odd numbers is even, and prove it."


@dataclass
class Hosts:
    """Host A (api, batcher, tiny's worker; big is served, listed and routable, without a worker yet),
    and what starting big's worker as a second host on the same Redis takes."""

    a: Stack
    start: Callable[[], Stack]


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory, redis_url: str, tiny_model: Path) -> Iterator[Hosts]:
    tmp = tmp_path_factory.mktemp("auto")
    models = {"tiny": tiny_model, "big": make_tiny_model(tmp / "big", layers=8, seed=1)}
    env = {"CONVEYOR_TORCH_THREADS": "1", "CONVEYOR_ROUTES": json.dumps(ROUTES)}
    served = ("--model", "tiny", "--model", "big")

    def host(name: str, only: str, namespace: str | None = None) -> Stack:
        (tmp / name).mkdir()
        return start_stack(
            tmp / name,
            redis_url=redis_url,
            models=models,
            default_model="tiny",
            extra_env=env,
            args=(*served, "--only", only),
            namespace=namespace,
            wait_ready=False,
        )

    a = host("a", "api,batcher,stage:tiny:0")
    stacks = [a]
    try:
        wait_for(lambda: _live(a, "tiny"), "tiny's worker")
        yield Hosts(a, lambda: stacks.append(host("b", "stage:big:0", a.namespace)) or stacks[-1])
    finally:
        for s in reversed(stacks):
            s.stop()


def wait_for(condition, what: str, timeout_s: float = 120.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"no {what} within {timeout_s:g} s")


def _live(stack: Stack, model: str) -> bool:
    checks = httpx.get(f"{stack.url}/readyz", timeout=5).json()["checks"]
    return bool(checks.get("models", {}).get(model, {}).get("live_per_stage", {}).get("0"))


def routed(stack: Stack) -> dict[tuple[str, str, str], float]:
    """`conveyor_routes_total` by (route, model, reason), as the api exports it."""
    text = httpx.get(f"{stack.url}/metrics", timeout=10).text
    counts = {}
    for labels, value in re.findall(r"^conveyor_routes_total\{(.*?)\} (\S+)$", text, re.M):
        found = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        counts[(found["route"], found["model"], found["reason"])] = float(value)
    return counts


def run(client: httpx.Client, prompt: str, model: str = "auto", **body: object) -> tuple[dict, dict]:  # type: ignore[type-arg]
    accepted = submit(client, **{"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, **body})
    return accepted, wait(client, accepted["id"])


def test_auto_falls_back_while_a_pipeline_is_down_then_routes_by_the_input(hosts: Hosts) -> None:
    a = hosts.a
    with a.client() as client:
        # big has no worker: its pipeline is down, so the long and the complex prompts fall back to tiny
        for prompt in (LONG, COMPLEX):
            accepted, done = run(client, prompt)
            assert (accepted["model"], accepted["route"]) == ("tiny", "auto")
            assert done["status"] == "succeeded", done
            assert (done["model"], done["route"], done["route_reason"]) == ("tiny", "auto", "fallback_down")
        _, short = run(client, SHORT)
        assert (short["model"], short["route_reason"]) == ("tiny", "simple")

        # big's worker starts, as a second host would on the same Redis
        hosts.start()
        wait_for(lambda: _live(a, "big"), "big's worker")

        jobs = {
            name: run(client, prompt)
            for name, prompt in (("short", SHORT), ("long", LONG), ("complex", COMPLEX))
        }
        jobs["max_tokens"] = run(client, SHORT, model="quick", max_tokens=5)  # over quick's max_tokens of 4
        completion = client.post("/v1/completions", json={"model": "auto", "prompt": SHORT, "max_tokens": 4})
        messages = [{"role": "user", "content": COMPLEX}]
        chat = client.post(
            "/v1/chat/completions", json={"model": "auto", "messages": messages, "max_tokens": 4}
        )
        unknown = client.post("/v1/jobs", json={"model": "auto2", "prompt": SHORT})
        listed = client.get("/v1/models").json()["data"]
        one = client.get("/v1/models/auto")
        counts = routed(a)

    want = {
        "short": ("tiny", "auto", "simple"),
        "long": ("big", "auto", "prompt_length"),
        "complex": ("big", "auto", "complexity"),
        "max_tokens": ("big", "quick", "max_tokens"),
    }
    for name, (accepted, done) in jobs.items():
        assert done["status"] == "succeeded", (name, done)
        assert (done["model"], done["route"], done["route_reason"]) == want[name], name
        assert accepted["model"] == want[name][0], name
    assert completion.status_code == 200 and completion.json()["model"] == "tiny", completion.text
    assert chat.status_code == 200 and chat.json()["model"] == "big", chat.text
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"

    assert [(m["id"], m["kind"]) for m in listed] == [
        ("tiny", "generation"),
        ("big", "generation"),
        ("auto", "route"),
        ("quick", "route"),
    ]
    policy = {"small": "tiny", "large": "big", "max_prompt_chars": 100, "max_tokens": 256}
    policy |= {"max_complexity": 0.3, "deadline_s": 30.0}
    assert listed[2]["route"] == policy and listed[2]["object"] == "model"
    assert one.status_code == 200 and one.json() == listed[2]

    assert counts == {
        ("auto", "tiny", "fallback_down"): 2.0,
        ("auto", "tiny", "simple"): 3.0,  # before big's worker, after it, and the OpenAI completion
        ("auto", "big", "prompt_length"): 1.0,
        ("auto", "big", "complexity"): 2.0,  # a job and the chat completion
        ("quick", "big", "max_tokens"): 1.0,
    }
