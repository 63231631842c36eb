"""The stack as a user starts it (`conveyor up`), with no Redis configured: the embedded one runs.

One stack serves the module's tests in their order, the last of which stops it: a chat job and
Flower behind its login; the embedded Redis's password (below); a killed worker restarted; SIGTERM
stopping every child. SmolLM2 answering "Paris" starts a stack of its own.

The embedded Redis of `conveyor up` requires a password: anything on the machine reaches a loopback
port, and whoever writes to Redis can add an API key for any tenant or read every prompt. The
password is generated into an owner-only file under CONVEYOR_HOME, the children get it in REDIS_URL,
and it appears on no command line and in no log line; the stack works as before, and the CLI finds
the password for itself.
"""

from __future__ import annotations

import signal
import stat
import time
from pathlib import Path

import httpx
import psutil
import pytest
import redis as redis_lib
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


def test_the_embedded_redis_refuses_unauthenticated_clients_and_the_stack_works(embedded_stack):  # type: ignore[no-untyped-def]
    port = int(embedded_stack.env["CONVEYOR_EMBEDDED_REDIS_PORT"])
    home = Path(embedded_stack.env["CONVEYOR_HOME"])
    with pytest.raises(redis_lib.AuthenticationError):  # NOAUTH: no password, no commands
        redis_lib.Redis(host="127.0.0.1", port=port, socket_timeout=5).ping()
    with pytest.raises(redis_lib.AuthenticationError):
        redis_lib.Redis(host="127.0.0.1", port=port, password="guess", socket_timeout=5).ping()

    secret = home / "redis_password"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    password = secret.read_text().strip()
    assert len(password) >= 32
    assert redis_lib.Redis(host="127.0.0.1", port=port, password=password).ping()

    with embedded_stack.client() as client:  # every child reaches Redis with the password it was given
        job = submit(client, prompt="Hello", max_tokens=4, temperature=0)
        assert wait(client, job["id"])["status"] == "succeeded"

    everyone = psutil.Process(embedded_stack.process.pid).children(recursive=True)
    assert any("redis-server" in " ".join(c.cmdline()) for c in everyone)
    assert any("flower" in c.cmdline() for c in everyone)
    for child in everyone:  # not on any command line (`ps` shows them to every local user)
        assert password not in " ".join(child.cmdline()), child.cmdline()
    assert password not in embedded_stack.log.read_text()

    made = embedded_stack.keys_create("ops")
    assert made.returncode == 0, made.stderr  # the CLI read the password file
    assert made.stdout.strip().startswith("cvk_")


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


def test_sigterm_stops_every_child(embedded_stack):  # type: ignore[no-untyped-def]
    """The module's last test on its stack: it stops it."""
    procs = list(children(embedded_stack).values())
    assert len(procs) == 5  # redis-server, the api, the batcher, the worker, Flower
    assert embedded_stack.stop() == 0
    gone, alive = psutil.wait_procs(procs, timeout=5)
    assert not alive, [p.cmdline() for p in alive]
    assert "[conveyor] stopped" in embedded_stack.log.read_text()


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
