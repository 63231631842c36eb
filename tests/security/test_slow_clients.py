"""Slow clients cannot take the API down: connections that never finish their headers neither exhaust
its file descriptors nor stay open, and a client with a real request still gets in.

`conveyor api` as a process (uvicorn, the tiny model, a real Redis, API keys), started with a soft
limit of 1,024 open files under a hard limit of 2,048; 2,500 connections then open and send
nothing (or half a request's headers). Before the fix the API stopped accepting at its soft limit
(`/healthz` waited for ever) and kept every such connection open. 20,000 held against a whole
stack: bench/results/slow_clients.md. Where nginx is installed, the shipped proxy configuration runs
in front of the same API: requests pass, idle connections close, an oversized body stops there.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import resource
import selectors
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import websockets
from conftest import ROOT, free_port

from app.api.auth import key_digest, new_api_key
from tests.tinyapi import forget_namespace

# The module's tests share one API process (seconds to start): one xdist worker runs them all.
pytestmark = pytest.mark.xdist_group("slow-clients")

SOFT, HARD = 1024, 2048  # the API's descriptor limits at its start
IDLE = 2500  # connections that never send their headers: more than either limit
HEADER_TIMEOUT_S = 2.0  # the API's is 10 s: the test waits seconds, not tens
# `conveyor api` (app.cli's `api`) with HEADER_TIMEOUT_S as app/api/connections.py's constant.
API = (
    f"import app.api.connections as c; c.HEADER_TIMEOUT_S = {HEADER_TIMEOUT_S}; "
    "import app.cli; app.cli.main()"
)


def lowered_fd_limit() -> None:  # in the child, before exec
    resource.setrlimit(resource.RLIMIT_NOFILE, (SOFT, HARD))


@pytest.fixture(scope="module")
def api(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, tiny_model: Path
) -> Iterator[tuple[str, str, int]]:
    """The API's URL, an API key and the API's pid."""
    tmp_path = tmp_path_factory.mktemp("slow-clients")
    key, port, namespace = new_api_key(), free_port(), f"test-slow-{os.getpid()}-{time.monotonic_ns()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_") and k != "REDIS_URL"}
    env |= {
        "REDIS_URL": redis_url,
        "CONVEYOR_HOME": str(tmp_path / "home"),
        "CONVEYOR_NAMESPACE": namespace,
        "CONVEYOR_API_PORT": str(port),
        "CONVEYOR_MODELS": json.dumps({"tiny": str(tiny_model)}),
        "CONVEYOR_DEFAULT_MODEL": "tiny",
        "CONVEYOR_EMBEDDING_STAGES": "0",
        "CONVEYOR_API_KEYS": json.dumps({key_digest(key): "acme"}),
        # No workers: the stage gate would refuse after its grace (2 x the heartbeat TTL).
        "CONVEYOR_HEARTBEAT_TTL_S": "5e8",
    }
    log = (tmp_path / "api.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-c", API, "api"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        preexec_fn=lowered_fd_limit,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        with httpx.Client(timeout=1) as poll:  # one client for every poll (conftest.start_stack)
            while True:
                assert process.poll() is None, (tmp_path / "api.log").read_text()
                try:
                    if poll.get(f"{url}/healthz").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, "the API did not start"
                time.sleep(0.2)
        yield url, key, process.pid
    finally:
        process.terminate()
        process.wait(30)
        log.close()
        forget_namespace(redis_url, namespace)


def open_idle(port: int, n: int) -> list[socket.socket]:
    held = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.setblocking(False)
        held.append(s)
    return held


def wait_all_closed(sockets: list[socket.socket], within_s: float) -> list[socket.socket]:
    """Wait until the server has closed every socket (EOF or reset); those still open at the end."""
    selector = selectors.DefaultSelector()
    for s in sockets:
        selector.register(s, selectors.EVENT_READ)
    deadline = time.monotonic() + within_s
    while selector.get_map() and time.monotonic() < deadline:
        for ready, _ in selector.select(timeout=0.5):
            s = ready.fileobj
            assert isinstance(s, socket.socket)
            try:
                data = s.recv(4096)
            except ConnectionError:
                data = b""
            if not data:
                selector.unregister(s)
    left = [key.fileobj for key in selector.get_map().values()]
    selector.close()
    return left  # type: ignore[return-value]


def test_idle_connections_neither_keep_clients_out_nor_stay_open(api):  # type: ignore[no-untyped-def]
    url, key, pid = api
    port = int(url.rsplit(":", 1)[1])
    idle = open_idle(port, IDLE)
    slow = open_idle(port, 2)  # half a request's headers, then nothing
    for s in slow:
        s.send(b"GET /healthz HTTP/1.1\r\nHost: api\r\n")
    try:
        with httpx.Client(base_url=url, timeout=10) as client:
            assert client.get("/healthz").status_code == 200
            answer = client.post(
                "/v1/jobs", json={"prompt": "hi", "max_tokens": 2}, headers={"X-API-Key": key}
            )
            assert answer.status_code == 202, answer.text
        left = wait_all_closed(idle + slow, within_s=HEADER_TIMEOUT_S + 20)
        assert not left, f"{len(left)} of {len(idle) + len(slow)} connections without a request still open"
    finally:
        for s in idle + slow:
            s.close()
    limits = Path(f"/proc/{pid}/limits").read_text().splitlines()
    soft = next(line for line in limits if line.startswith("Max open files")).split()[3]
    assert int(soft) == HARD  # raised to the hard limit at start


def test_a_kept_alive_connection_is_closed_once_its_next_request_is_late(api):  # type: ignore[no-untyped-def]
    url, _, _ = api
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: api\r\n\r\n")
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
        s.sendall(b"GET /healthz HTTP/1.1\r\n")  # disarms uvicorn's keep-alive timer; never finished
        s.setblocking(False)
        assert not wait_all_closed([s], within_s=HEADER_TIMEOUT_S + 10)


def test_a_websocket_outlives_the_header_timeout(api):  # type: ignore[no-untyped-def]
    url, key, _ = api
    job = httpx.post(f"{url}/v1/jobs", json={"prompt": "hi", "max_tokens": 2}, headers={"X-API-Key": key})
    assert job.status_code == 202, job.text

    async def follow() -> str:
        ws_url = url.replace("http", "ws", 1) + f"/v1/jobs/{job.json()['id']}/ws"
        async with websockets.connect(ws_url, additional_headers={"X-API-Key": key}) as ws:
            try:  # no worker runs the job: nothing comes, and the connection stays
                await asyncio.wait_for(ws.recv(), HEADER_TIMEOUT_S * 2)
            except TimeoutError:
                return "open"
            except websockets.ConnectionClosed as closed:
                return f"closed: {closed}"
            return "a message"

    assert asyncio.run(follow()) == "open"


@pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx is not installed")
def test_the_proxy_in_front_closes_idle_connections_and_passes_requests(api, tmp_path):  # type: ignore[no-untyped-def]
    """deploy/nginx/nginx.conf as shipped, but for the upstream's address, its port and its files:
    a request goes through, an idle connection is closed after client_header_timeout, a body over
    the limit is 413 at the proxy."""
    url, key, _ = api
    port = free_port()
    conf = (ROOT / "deploy" / "nginx" / "nginx.conf").read_text()
    conf = conf.replace("server api:8000;", f"server {url.removeprefix('http://')};")
    conf = conf.replace("listen 8080;", f"listen 127.0.0.1:{port};").replace("/tmp/", f"{tmp_path}/")
    (tmp_path / "nginx.conf").write_text(conf)
    timeout_s = int(re.search(r"client_header_timeout (\d+)s;", conf).group(1))  # type: ignore[union-attr]
    nginx = subprocess.Popen(["nginx", "-c", str(tmp_path / "nginx.conf"), "-g", "daemon off;"])
    proxy = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                answer = httpx.get(f"{proxy}/healthz", timeout=2)
                break
            except httpx.TransportError:
                assert nginx.poll() is None and time.monotonic() < deadline, "nginx did not start"
                time.sleep(0.2)
        assert answer.status_code == 200
        job = httpx.post(
            f"{proxy}/v1/jobs", json={"prompt": "hi", "max_tokens": 2}, headers={"X-API-Key": key}
        )
        assert job.status_code == 202, job.text
        too_big = httpx.post(f"{proxy}/v1/jobs", content=b"x" * (1024 * 1024 + 1), headers={"X-API-Key": key})
        assert too_big.status_code == 413
        idle = open_idle(port, 3)
        assert not wait_all_closed(idle, within_s=timeout_s + 10)
    finally:
        nginx.terminate()
        nginx.wait(10)
