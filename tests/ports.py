"""Ports for the servers tests start, unique across every test process on the machine.

A port the kernel hands out for `bind(("127.0.0.1", 0))` is free when it is handed out, not when the
server that is given it binds it seconds later (a stack's api imports torch first): meanwhile the
kernel may hand the same port to another test process (the other xdist worker, the e2e lane), whose
server binds it first. The test then polls the other one's server, ready, and talks to it (a 401
from a stack with other keys, or its connection refused once that stack stops).

So each port is claimed by a file of its own (`O_EXCL`) in a directory every test process shares,
and is taken from below Linux's ephemeral range (32768-60999), where no client connection's source
port lands either. A claim lapses after CLAIM_S: a run's processes keep theirs for the run.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import tempfile
import time
from pathlib import Path

CLAIMS = Path(tempfile.gettempdir()) / "conveyor-test-ports"
FIRST, LAST = 20000, 32767  # below the ephemeral range (/proc/sys/net/ipv4/ip_local_port_range)
CLAIM_S = 3600.0


def free_port() -> int:
    return free_ports(1)


def free_ports(n: int) -> int:
    """The first of `n` consecutive ports, each free on 127.0.0.1 and claimed by this process
    (`conveyor up` numbers metrics ports upwards from the first)."""
    CLAIMS.mkdir(exist_ok=True)
    for _ in range(1000):
        base = FIRST + secrets.randbelow(LAST - FIRST - n + 2)
        claimed = []
        for port in range(base, base + n):
            if not _claim(port):
                break
            claimed.append(port)
        if len(claimed) == n and _bindable(claimed):
            return base
        # What this try claimed stays claimed until the claim lapses: no one is given it meanwhile.
    raise RuntimeError(f"no {n} consecutive free ports in {FIRST}-{LAST}")


def _claim(port: int) -> bool:
    path = CLAIMS / str(port)
    for _ in range(2):
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            return True
        except FileExistsError:
            try:
                if time.time() - path.stat().st_mtime < CLAIM_S:
                    return False
                path.unlink()  # a lapsed claim: an earlier run's
            except FileNotFoundError:
                pass  # released meanwhile: try again
    return False


def _bindable(ports: list[int]) -> bool:
    try:
        with contextlib.ExitStack() as held:
            for port in ports:
                s = held.enter_context(socket.socket())
                s.bind(("127.0.0.1", port))
    except OSError:
        return False
    return True
