"""`conveyor plan --rebalance` as the docs show it beside `make run`: no REDIS_URL in the shell, the
workers' latency reports read from the embedded Redis the running stack uses.

The command runs in process (Click's runner) with the shell's environment replaced for the call:
the CLI builds its `Settings` from the environment at each command, as a fresh process would."""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass

import redis as redis_lib
from typer.testing import CliRunner

from app.cli import cli
from app.core.keys import Keys
from app.workers.latency import StepLatency


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str


def conveyor(*args: str, env: dict[str, str]) -> Ran:
    """`conveyor ARGS` with exactly `env`'s CONVEYOR_* settings and REDIS_URL (the rest are unset)."""
    unset: dict[str, str | None] = {
        k: None for k in os.environ if k.startswith("CONVEYOR_") or k == "REDIS_URL"
    }
    result = CliRunner().invoke(cli, list(args), env={**unset, **env})
    return Ran(result.exit_code, result.stdout, result.stderr)


def test_rebalance_reads_the_embedded_redis_without_redis_url(tiny_model, tmp_path):  # type: ignore[no-untyped-def]
    """As beside `make run`: the embedded Redis of a home, its password in the home's file."""
    from conftest import free_port

    from app.core.redis import ensure_password, password_file, start_embedded

    home, port = tmp_path / "home", free_port()
    process, url = start_embedded(home / "redis", port, password=ensure_password(password_file(home)))
    redis = redis_lib.Redis.from_url(url)
    namespace = f"test-{uuid.uuid4().hex[:8]}"
    env = {
        "CONVEYOR_HOME": str(home),
        "CONVEYOR_NAMESPACE": namespace,
        "CONVEYOR_EMBEDDED_REDIS_PORT": str(port),  # where `make run` started it
        "CONVEYOR_MODELS": f'{{"tiny": "{tiny_model}"}}',
        "CONVEYOR_DEFAULT_MODEL": "tiny",
    }
    try:
        plan = tmp_path / "plan.json"
        made = conveyor("plan", "--stages", "2", "--dtype", "float32", "--out", str(plan), env=env)
        assert made.returncode == 0, made.stderr
        keys = Keys(namespace)
        # Stage 0 measured three times as slow as stage 1: the cut must move towards stage 0.
        for stage, seconds in ((0, 0.030), (1, 0.010)):
            StepLatency(redis, keys, "tiny", stage, (0, 1), f"w{stage}", ewma_s=seconds).report(0.0)
        answer = conveyor("plan", "--rebalance", str(plan), env=env)
    finally:
        process.terminate()
        process.wait(10)
    assert answer.returncode == 0, answer.stderr
    assert "measured: stage 0 30.0 ms, stage 1 10.0 ms" in answer.stdout


def test_rebalance_says_so_when_no_redis_answers(tiny_model, tmp_path):  # type: ignore[no-untyped-def]
    from conftest import free_port

    from app.core.redis import ensure_password, password_file

    home = tmp_path / "home"
    ensure_password(password_file(home))  # a stack's home, its Redis stopped
    env = {
        "CONVEYOR_HOME": str(home),
        "CONVEYOR_EMBEDDED_REDIS_PORT": str(free_port()),  # nothing listens there
        "CONVEYOR_MODELS": f'{{"tiny": "{tiny_model}"}}',
        "CONVEYOR_DEFAULT_MODEL": "tiny",
    }
    plan = tmp_path / "plan.json"
    assert (
        conveyor("plan", "--stages", "2", "--dtype", "float32", "--out", str(plan), env=env).returncode == 0
    )
    answer = conveyor("plan", "--rebalance", str(plan), env=env)
    assert answer.returncode == 2
    assert "Redis does not answer" in answer.stderr
