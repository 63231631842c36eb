"""`conveyor up` as an operator meets it (whole stacks, the tiny model, the embedded Redis):

- SIGKILL of the `conveyor up` process (an OOM kill, `kill -9`) takes every child down with it: no
  api, worker or Redis is left holding the ports for the next start;
- a port already in use is named at start, before anything is started.
"""

from __future__ import annotations

import signal
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
from conftest import free_ports, start_stack


@pytest.mark.e2e  # the supervisor and its children
def test_sigkill_of_the_supervisor_leaves_no_child(tmp_path: Path, tiny_model: Path) -> None:
    stack = start_stack(
        tmp_path,
        redis_url=None,  # the embedded Redis: the child that held its port in the reported failure
        models={"tiny": tiny_model},
        default_model="tiny",
        flower=True,
        extra_env={"CONVEYOR_TORCH_THREADS": "1", "CONVEYOR_METRICS_PORT": str(free_ports(8))},
    )
    children = psutil.Process(stack.process.pid).children(recursive=True)
    names = {" ".join(child.cmdline()[2:4]) for child in children}
    try:
        assert len(children) >= 6, names  # redis, api, batcher, webhooks x2, stage0, flower
        stack.process.send_signal(signal.SIGKILL)
        stack.process.wait(10)
        # They get SIGTERM and shut down as they would (a loaded machine took over 5 s once): a
        # generous ceiling, the condition is that none is left.
        _, alive = psutil.wait_procs(children, timeout=60)
        assert not [p for p in alive if running(p)], [(p.pid, p.name()) for p in alive if running(p)]
    finally:
        for child in children:  # on a failure: ours to clean up, by pid
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass


def running(process: psutil.Process) -> bool:
    """Alive and not a zombie (a dead child nobody reaped yet holds no port)."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@contextmanager
def held_port() -> Iterator[int]:
    """A port some other program listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


@pytest.mark.parametrize(
    ("setting", "what"),
    [
        ("CONVEYOR_API_PORT", "the API"),
        ("CONVEYOR_EMBEDDED_REDIS_PORT", "the embedded Redis"),
        ("CONVEYOR_FLOWER_PORT", "Flower"),
        ("CONVEYOR_METRICS_PORT", "metrics of"),
    ],
)
@pytest.mark.e2e  # the supervisor and its children
def test_a_port_in_use_is_named_before_anything_starts(tmp_path, tiny_model, setting, what):  # type: ignore[no-untyped-def]
    with held_port() as port:
        started = time.monotonic()
        try:
            stack = start_stack(
                tmp_path,
                redis_url=None,
                models={"tiny": tiny_model},
                default_model="tiny",
                flower=True,
                extra_env={"CONVEYOR_METRICS_PORT": str(free_ports(8)), setting: str(port)},
                ready_timeout_s=60,
            )
        except RuntimeError as exc:
            log = str(exc)
        else:
            stack.stop()
            pytest.fail(f"the stack started although port {port} was taken")
    assert "exited early" in log, log
    assert f"port {port} ({what}" in log and "already in use" in log, log
    assert "started embedded Redis" not in log, log  # nothing was started
    assert time.monotonic() - started < 30
