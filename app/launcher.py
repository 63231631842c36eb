"""`conveyor up`: start the whole stack in the foreground and supervise it.

Children: Redis (embedded, when no REDIS_URL is given), the api, the batcher, the webhook
dispatcher and callbacks worker, one worker per stage, and Flower. Each child's output is prefixed
with its name. A child that exits on its own is reported and restarted with backoff; one that keeps
dying (more than `MAX_RESTARTS` times within `RESTART_WINDOW_S`) brings the stack down with a
non-zero exit, and so does the embedded Redis dying. A stage worker whose model cannot be served
exits with `UNSERVABLE_EXIT`: it is left down, and the other models go on serving. Ctrl-C or
SIGTERM stops every child: api first, Redis last, SIGKILL after a grace period.

The supervisor dying any other way (SIGKILL, the OOM killer) takes the children with it: on Linux
each child asks the kernel for SIGTERM when its parent dies (`die_with_parent`), so none is left
holding a port for the next start. And before anything starts, `ports_in_use` names every port of
the stack that another program holds.
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# How a stage worker exits when its model cannot be served (sysexits' EX_CONFIG): a restart would
# refuse it again, so the worker is not restarted and the stack goes on without that model.
UNSERVABLE_EXIT = 78

MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
STOP_GRACE_S = 15.0


@dataclass
class Child:
    name: str
    argv: list[str]
    restart: bool = True
    env: dict[str, str] = field(default_factory=dict)  # on top of the supervisor's environment
    process: subprocess.Popen[bytes] | None = None
    restarts: deque[float] = field(default_factory=deque)
    given_up: bool = False  # exited with UNSERVABLE_EXIT: left down, not restarted


class Supervisor:
    def __init__(self, env: dict[str, str], *, out: IO[str] = sys.stdout) -> None:
        self.env = env
        self.out = out
        self.children: list[Child] = []
        self.stopping = threading.Event()
        self._lock = threading.Lock()

    def say(self, line: str) -> None:
        with self._lock:
            self.out.write(f"[conveyor] {line}\n")
            self.out.flush()

    def add(self, child: Child, process: subprocess.Popen[bytes] | None = None) -> None:
        """Register a child; start it unless an already running process is handed over."""
        self.children.append(child)
        if process is not None:
            child.process = process
        else:
            self._spawn(child)

    def _spawn(self, child: Child) -> None:
        """Start a child. Called from the main thread only (`add`, `run`): Linux sends the death
        signal when the thread that forked the child ends, and the main thread ends with us."""
        # Its own session: a terminal's Ctrl-C reaches only us, and we stop children in order.
        child.process = subprocess.Popen(
            child.argv,
            env={**self.env, **child.env},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent(),
        )
        threading.Thread(target=self._relay, args=(child.name, child.process), daemon=True).start()

    def _relay(self, name: str, process: subprocess.Popen[bytes]) -> None:
        assert process.stdout is not None
        for raw in iter(process.stdout.readline, b""):
            with self._lock:
                self.out.write(f"[{name}] {raw.decode(errors='replace').rstrip()}\n")
                self.out.flush()

    def run(self) -> int:
        """Supervise until a stop signal (exit 0) or a child that cannot be kept up (exit 1)."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: self.stopping.set())
        code = 0
        while not self.stopping.wait(0.5):
            failed = self._check()
            if failed:
                self.say(f"{failed} keeps failing; stopping the stack")
                code = 1
                break
        self.shutdown()
        return code

    def _check(self) -> str | None:
        for child in self.children:
            assert child.process is not None
            rc = child.process.poll()
            if rc is None or child.given_up:
                continue
            self.say(f"{child.name} exited with code {rc}")
            if rc == UNSERVABLE_EXIT and child.restart:
                child.given_up = True
                self.say(f"{child.name} cannot serve its model (its reason is above): not restarting it")
                continue
            now = time.monotonic()
            while child.restarts and now - child.restarts[0] > RESTART_WINDOW_S:
                child.restarts.popleft()
            if not child.restart or len(child.restarts) >= MAX_RESTARTS:
                return child.name
            child.restarts.append(now)
            delay = min(8.0, 0.5 * 2 ** (len(child.restarts) - 1))
            self.say(f"restarting {child.name} in {delay:g} s")
            time.sleep(delay)
            self._spawn(child)
        return None

    def shutdown(self) -> None:
        """SIGTERM to the services in start order (the api first), then to Redis; SIGKILL after the grace."""
        services = [c for c in self.children if c.restart]
        infrastructure = [c for c in self.children if not c.restart]
        for group in (services, infrastructure):
            live = [c for c in group if c.process is not None and c.process.poll() is None]
            for child in live:
                self.say(f"stopping {child.name}")
                _signal(child.process, signal.SIGTERM)  # type: ignore[arg-type]
            deadline = time.monotonic() + STOP_GRACE_S
            for child in live:
                assert child.process is not None
                try:
                    child.process.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self.say(f"{child.name} did not stop in time; killing it")
                    _signal(child.process, signal.SIGKILL)
                    child.process.wait()
        self.say("stopped")


def _signal(process: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def die_with_parent() -> Callable[[], None] | None:
    """A `preexec_fn` that makes the child receive SIGTERM when this process dies, however it dies
    (`prctl(PR_SET_PDEATHSIG)`; the setting survives exec). None where there is no prctl (not Linux):
    there a SIGKILLed supervisor still leaves its children behind."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the request took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def ports_in_use(ports: list[tuple[str, int, str]]) -> list[str]:
    """'port N (what) is already in use' for each (host, port, what) that cannot be bound now, as
    the child that will serve it binds it (SO_REUSEADDR: a closed connection's TIME_WAIT does not
    count, a listening socket does)."""
    problems = []
    for host, port, what in ports:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    problems.append(f"port {port} ({what}) is already in use")
                else:
                    problems.append(f"port {port} ({what}) cannot be used on {host}: {exc.strerror}")
    return problems
