"""The embedded Redis of `conveyor up` requires a password: anything on the machine reaches a loopback
port, and whoever writes to Redis can add an API key for any tenant or read every prompt. The
password is generated into an owner-only file under CONVEYOR_HOME, the children get it in REDIS_URL,
and it appears on no command line and in no log line; the stack works as before, and the CLI finds
the password for itself.

A whole stack as a user starts it (tiny model, embedded Redis: redis_url=None)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import redis as redis_lib
from clients import submit, wait
from conftest import ROOT, free_port, start_stack


@pytest.mark.e2e  # the embedded Redis `up` starts, and its children's environment
def test_embedded_redis_refuses_unauthenticated_clients_and_the_stack_works(
    tmp_path: Path, tiny_model: Path
) -> None:
    port = free_port()
    stack = start_stack(
        tmp_path,
        redis_url=None,
        models={"tiny": tiny_model},
        default_model="tiny",
        flower=True,
        extra_env={"CONVEYOR_TORCH_THREADS": "1", "CONVEYOR_EMBEDDED_REDIS_PORT": str(port)},
    )
    try:
        with pytest.raises(redis_lib.AuthenticationError):  # NOAUTH: no password, no commands
            redis_lib.Redis(host="127.0.0.1", port=port, socket_timeout=5).ping()
        with pytest.raises(redis_lib.AuthenticationError):
            redis_lib.Redis(host="127.0.0.1", port=port, password="guess", socket_timeout=5).ping()

        secret = tmp_path / "home" / "redis_password"
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
        password = secret.read_text().strip()
        assert len(password) >= 32
        assert redis_lib.Redis(host="127.0.0.1", port=port, password=password).ping()

        with stack.client() as client:  # every child reaches Redis with the password it was given
            job = submit(client, prompt="Hello", max_tokens=4, temperature=0)
            assert wait(client, job["id"])["status"] == "succeeded"

        children = psutil.Process(stack.process.pid).children(recursive=True)
        assert any("redis-server" in " ".join(c.cmdline()) for c in children)
        assert any("flower" in c.cmdline() for c in children)
        for child in children:  # not on any command line (`ps` shows them to every local user)
            assert password not in " ".join(child.cmdline()), child.cmdline()
        assert password not in stack.log.read_text()

        env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_") and k != "REDIS_URL"}
        env.update(
            {
                "CONVEYOR_HOME": str(tmp_path / "home"),
                "CONVEYOR_EMBEDDED_REDIS_PORT": str(port),
                "CONVEYOR_NAMESPACE": stack.namespace,
            }
        )
        made = subprocess.run(
            [sys.executable, "-m", "app.cli", "keys", "create", "--tenant", "ops"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert made.returncode == 0, made.stderr  # the CLI read the password file
        assert made.stdout.strip().startswith("cvk_")
    finally:
        stack.stop()
