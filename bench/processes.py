"""The benchmark's processes: server subprocesses, free ports, readiness waits, cleanup, progress lines.

A server runs in its own session with its output in a log file; on the way out it gets SIGTERM, then
SIGKILL after a timeout, and whatever it started that is still alive is killed, so that nothing a
benchmark started outlives it. `terminate_on_sigterm` makes SIGTERM unwind like Ctrl-C so that those
`finally` blocks run.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent  # the repository root: servers run there


def say(line: str) -> None:
    """A progress line on stderr (stdout is for the results)."""
    print(f"[bench] {line}", file=sys.stderr, flush=True)


def terminate_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so every `finally` stops the servers it started."""

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def server_process(
    name: str,
    argv: list[str],
    env: dict[str, str],
    log_path: Path,
    stop_timeout_s: float,
    cwd: Path = ROOT,
) -> Iterator[subprocess.Popen[bytes]]:
    """Run `argv` in `cwd` (a `python -m` there imports that tree's code) with its output in
    `log_path`; on the way out SIGTERM it, SIGKILL after the timeout."""
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        say(f"{name}: started pid {process.pid}, log {log_path}")
        try:
            yield process
        finally:
            stop(name, process, stop_timeout_s)


def stop(name: str, process: subprocess.Popen[bytes], timeout_s: float) -> None:
    if process.poll() is not None:
        say(f"{name}: had already exited with code {process.returncode}")
        return
    descendants = child_pids(process.pid)
    process.send_signal(signal.SIGTERM)
    try:
        code = process.wait(timeout_s)
        say(f"{name}: stopped (exit code {code})")
    except subprocess.TimeoutExpired:
        say(f"{name}: did not stop within {timeout_s:.0f} s; killing it and its children")
        process.kill()
        process.wait()
    for pid in descendants:  # normally already gone: `up` stops its own children
        kill_pid(pid)


def child_pids(pid: int) -> list[int]:
    """Every descendant of `pid` (Linux /proc), so that nothing a killed parent started outlives us."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_pid(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return
    say(f"killed leftover process {pid}")


def wait_ready(url: str, process: subprocess.Popen[bytes], timeout_s: float, log_path: Path) -> None:
    """Poll `url` until it answers 200; RuntimeError if the process exits first or the time runs out."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"exited with code {process.returncode} before ready; see {log_path}")
            try:
                answer = client.get(url)
                if answer.status_code == 200:
                    return
                last = f"{answer.status_code} {answer.text[:200]}"
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}"
            time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {timeout_s:.0f} s (last: {last}); see {log_path}")
