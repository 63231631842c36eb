"""The stack as a user starts it (`conveyor up`), with no Redis configured: the embedded one runs."""

from __future__ import annotations

import signal
import time

import httpx
import psutil
import pytest
from clients import events, submit, tokens, wait
from conftest import SMOLLM2, start_stack

# whole-stack smoke tests
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def embedded_stack(tmp_path_factory, tiny_model):  # type: ignore[no-untyped-def]
    stack = start_stack(
        tmp_path_factory.mktemp("e2e"),
        redis_url=None,
        models={"tiny": tiny_model},
        default_model="tiny",
        flower=True,
        extra_env={"CONVEYOR_FLOWER_BASIC_AUTH": "ops:s3cret"},
    )
    yield stack
    stack.stop()


def children(stack) -> dict[str, psutil.Process]:  # type: ignore[no-untyped-def]
    found = {}
    for proc in psutil.Process(stack.process.pid).children():
        try:
            line = " ".join(proc.cmdline())
        except psutil.Error:  # exited, not yet reaped by the launcher
            continue
        for name in ("redis-server", "app.cli api", "app.cli batcher", "app.cli worker", "flower"):
            if name in line:
                found[name] = proc
    return found


def test_embedded_stack_serves_a_chat_job_and_flower_behind_its_login(embedded_stack):  # type: ignore[no-untyped-def]
    assert set(children(embedded_stack)) == {
        "redis-server",
        "app.cli api",
        "app.cli batcher",
        "app.cli worker",
        "flower",
    }
    with embedded_stack.client() as client:
        job = submit(client, messages=[{"role": "user", "content": "Hello"}], max_tokens=10, temperature=0)
        stream = events(client, job["urls"]["events"])
    assert stream[-1].event == "done" and stream[-1].data["status"] == "succeeded"
    assert "".join(e.data["text"] for e in tokens(stream)) == stream[-1].data["text"]
    log = embedded_stack.log.read_text()
    assert "flower  http://127.0.0.1:" in log
    url = log.split("flower  ", 1)[1].split()[0]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2, auth=("ops", "s3cret")).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.5)
    else:
        raise AssertionError(f"Flower did not answer at {url}")
    assert httpx.get(url, timeout=5).status_code == 401
    assert httpx.get(url, timeout=5, auth=("ops", "wrong")).status_code == 401


def test_a_killed_worker_is_restarted_and_the_stack_keeps_serving(embedded_stack):  # type: ignore[no-untyped-def]
    worker = children(embedded_stack)["app.cli worker"]
    worker.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        current = children(embedded_stack).get("app.cli worker")
        if current is not None and current.pid != worker.pid:
            break
        time.sleep(0.2)
    else:
        raise AssertionError("the launcher did not restart the worker")
    assert "stage0 exited with code -9" in embedded_stack.log.read_text()
    with embedded_stack.client() as client:
        job = wait(client, submit(client, prompt="after restart", max_tokens=5, temperature=0)["id"])
    assert job["status"] == "succeeded"


def test_sigterm_stops_every_child(tmp_path, tiny_model):  # type: ignore[no-untyped-def]
    stack = start_stack(tmp_path, redis_url=None, models={"tiny": tiny_model}, default_model="tiny")
    procs = list(children(stack).values())
    assert len(procs) == 4
    assert stack.stop() == 0
    gone, alive = psutil.wait_procs(procs, timeout=5)
    assert not alive, [p.cmdline() for p in alive]
    assert "[conveyor] stopped" in stack.log.read_text()


@pytest.mark.slow
def test_smollm2_knows_the_capital_of_france(tmp_path, smollm2_dir):  # type: ignore[no-untyped-def]
    stack = start_stack(tmp_path, redis_url=None, models={SMOLLM2: smollm2_dir}, default_model=SMOLLM2)
    try:
        with stack.client() as client:
            job = submit(
                client,
                messages=[{"role": "user", "content": "What is the capital of France?"}],
                temperature=0,
                max_tokens=32,
            )
            stream = events(client, job["urls"]["events"])
    finally:
        stack.stop()
    final = stream[-1].data
    assert final["status"] == "succeeded"
    assert "Paris" in final["text"]
    assert "".join(e.data["text"] for e in tokens(stream)) == final["text"]
