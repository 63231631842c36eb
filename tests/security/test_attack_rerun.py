"""One representative of each attack class of the third hardening round, against one live stack
(`conveyor up` with API keys, as deployed): each gets its documented refusal (a 4xx, or a WebSocket
close code), a neighbour tenant's jobs complete meanwhile, and every job answered 202 completes.

    1 slow clients       header-less connections: closed after the header timeout, API answers meanwhile
    2 model packages     `conveyor model add <unknown package>`: refused before anything is downloaded
    3 tenant fills Redis past its retained-bytes quota: 429 tenant_quota_exceeded
    4 chat flood         30,000 empty messages: 422 before any rendering
    5 embeddings charge  a request padded past the tenant's whole per-minute limit: 422
    6 webhook secrets    a tenant's delivery does not verify with the shared secret
    7 edges              lone surrogate 400, bad Last-Event-ID 422 / 4422, foreign Host 400, foreign
                         WebSocket Origin 4403, realtime without the grant 403

The stack runs the embeddings pipeline's settings (CONVEYOR_EMBEDDING_STAGES=2) without its workers
(`--only`): the charge is taken before a job would be queued."""

from __future__ import annotations

import base64
import http.server
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from clients import wait
from conftest import ROOT, Stack, start_stack
from standardwebhooks.webhooks import Webhook, WebhookVerificationError
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from app.api.auth import key_digest, new_api_key
from app.api.connections import HEADER_TIMEOUT_S
from app.webhooks import signing

pytestmark = pytest.mark.e2e
ATTACKER, NEIGHBOUR = new_api_key(), new_api_key()
SHARED = "whsec_" + base64.b64encode(b"the shared secret of jobs without a tenant").decode()
MASTER = signing.generate()
HELD = 300  # header-less connections of class 1 (bench/results/slow_clients.md: 20,000)


class Receiver(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.received: list[tuple[dict[str, str], str]] = []


class _Handler(http.server.BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:  # noqa: N802
        body = self.rfile.read(int(self.headers.get("content-length") or 0)).decode()
        self.server.received.append(({k.lower(): v for k, v in self.headers.items()}, body))
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    server = Receiver()
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Stack]:
    s = start_stack(
        tmp_path_factory.mktemp("attacks"),
        redis_url=None,
        models={"tiny": tiny_model},
        default_model="tiny",
        args=("--only", "redis,api,batcher,webhooks,callbacks,stages"),
        extra_env={
            "CONVEYOR_API_KEYS": json.dumps(
                {key_digest(ATTACKER): "mallory", key_digest(NEIGHBOUR): "alice"}
            ),
            "CONVEYOR_EMBEDDING_STAGES": "2",
            "CONVEYOR_RATE_LIMITS": json.dumps(
                {
                    "mallory": {
                        "rps": 1000,
                        "burst": 1000,
                        "embedding_bytes_per_min": 4096,
                        "retained_bytes": 40_000,
                    }
                }
            ),
            "CONVEYOR_WEBHOOK_SECRETS": json.dumps([SHARED]),
            "CONVEYOR_WEBHOOK_MASTER_KEY": MASTER,
            "CONVEYOR_WEBHOOK_ALLOW_CIDRS": '["127.0.0.1/32"]',
            "CONVEYOR_TORCH_THREADS": "1",
        },
    )
    yield s
    s.stop()


def client(stack: Stack, key: str) -> httpx.Client:
    return stack.client(headers={"X-API-Key": key})


def refusal(answer: httpx.Response) -> tuple[int, str]:
    return answer.status_code, answer.json()["error"]["code"]


def ws_close(stack: Stack, path: str, **headers: str) -> int:
    url = stack.url.replace("http://", "ws://") + path
    with connect(url, additional_headers={"X-API-Key": ATTACKER, **headers}, open_timeout=30) as ws:
        try:
            ws.recv(timeout=30)
        except ConnectionClosed:
            pass
    assert ws.close_code is not None
    return ws.close_code


def test_every_attack_class_is_refused_and_no_neighbour_or_accepted_job_is_harmed(  # type: ignore[no-untyped-def]
    stack, receiver, tmp_path
):
    table: list[tuple[str, str, str]] = []
    accepted: list[tuple[httpx.Client, str]] = []
    mallory, alice = client(stack, ATTACKER), client(stack, NEIGHBOUR)

    def submit(who: httpx.Client, **body: Any) -> httpx.Response:
        answer = who.post("/v1/jobs", json={"max_tokens": 2, "temperature": 0, **body})
        if answer.status_code == 202:
            accepted.append((who, answer.json()["id"]))
        return answer

    neighbour = submit(alice, prompt="the neighbour's first job")
    assert neighbour.status_code == 202, neighbour.text

    # 1. Slow clients: connections that never send their headers are closed; the API keeps answering.
    host, port = stack.url.removeprefix("http://").split(":")
    held = [socket.create_connection((host, int(port)), timeout=5) for _ in range(HELD)]
    try:
        assert httpx.get(f"{stack.url}/healthz", timeout=5).status_code == 200
        assert submit(alice, prompt="while idle connections are held").status_code == 202
        held[0].settimeout(HEADER_TIMEOUT_S + 10)
        assert held[0].recv(1) == b""  # closed by the server at the header timeout
    finally:
        for s in held:
            s.close()
    table.append(("1 slow clients", f"{HELD} header-less connections", "closed after the header timeout"))

    # 2. An unknown package name is never downloaded nor imported.
    env = {**stack.env, "CONVEYOR_HOME": str(tmp_path / "home")}
    added = subprocess.run(
        [sys.executable, "-m", "app.cli", "model", "add", "tiny-gguf"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert added.returncode == 2 and "not a known model package" in added.stdout + added.stderr
    table.append(("2 model packages", "model add tiny-gguf", "exit 2, not a known model package"))

    # 4. A chat of 30,000 empty messages is refused before it is rendered.
    started = time.monotonic()
    flood = mallory.post("/v1/jobs", json={"messages": [{"role": "user", "content": ""}] * 30_000})
    assert refusal(flood) == (422, "invalid_request") and time.monotonic() - started < 5
    table.append(("4 chat flood", "30,000 empty messages", "422 invalid_request"))

    # 3. One tenant filling Redis is stopped at its retained-bytes quota; the neighbour is admitted.
    for n in range(200):
        answer = submit(mallory, prompt=f"fill {n} " + "x" * 400)
        if answer.status_code != 202:
            break
    assert refusal(answer) == (429, "tenant_quota_exceeded"), answer.text
    assert "retry-after" in answer.headers
    assert submit(alice, prompt="admitted beside the full tenant").status_code == 202
    table.append(("3 tenant fills Redis", f"{n} jobs, then one more", "429 tenant_quota_exceeded"))

    # 5. Embeddings are charged their padded positions: past the whole per-minute limit, 422.
    padded = mallory.post("/v1/embeddings", json={"input": ["x" * 300] + ["a"] * 63})
    assert refusal(padded) == (422, "invalid_request") and padded.json()["error"]["details"] == {
        "limit": 4096
    }
    table.append(("5 embeddings charge", "363 bytes padded to 64 x 152 positions", "422 invalid_request"))

    # 6. A tenant given its own webhook secret is signed with it, never with the shared one.
    rotated = subprocess.run(
        [sys.executable, "-m", "app.cli", "keys", "rotate-webhook-secret", "--tenant", "alice"],
        cwd=ROOT,
        env=stack.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert rotated.returncode == 0, rotated.stderr
    own = rotated.stdout.split()[-1]
    url = f"http://127.0.0.1:{receiver.server_address[1]}/hook"
    hooked = submit(alice, prompt="with a callback", callback_url=url)
    assert hooked.status_code == 202, hooked.text
    deadline = time.monotonic() + 60
    while not receiver.received and time.monotonic() < deadline:
        time.sleep(0.1)
    headers, body = receiver.received[0]
    Webhook(own).verify(body, headers)
    with pytest.raises(WebhookVerificationError):
        Webhook(SHARED).verify(body, headers)
    table.append(("6 webhook secrets", "alice's delivery checked with the shared secret", "does not verify"))

    # 7. The edges: each a clear 4xx or close code.
    job_id = accepted[0][1]
    surrogate = mallory.post(
        "/v1/jobs",
        content=b'{"prompt": "\\ud800", "max_tokens": 2}',
        headers={"content-type": "application/json"},
    )
    assert refusal(surrogate) == (400, "bad_request")
    beyond = alice.get(f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": "18446744073709551616-0"})
    assert refusal(beyond) == (422, "invalid_request")
    foreign = mallory.get(f"/v1/jobs/{job_id}", headers={"host": "attacker.example"})
    assert refusal(foreign) == (400, "host_not_allowed")
    realtime = submit(mallory, prompt="jump the queue", priority="realtime")
    assert refusal(realtime) == (403, "priority_not_allowed")
    newline = ws_close(stack, f"/v1/jobs/{job_id}/ws?last_event_id={quote('1-0' + chr(10))}")
    origin = ws_close(stack, f"/v1/jobs/{job_id}/ws", Origin="https://attacker.example")
    assert (newline, origin) == (4422, 4403)
    table.append(("7 lone surrogate", '"\\ud800" in a JSON body', "400 bad_request"))
    table.append(("7 Last-Event-ID", "2^64-0 on SSE; '1-0\\n' on the WebSocket", "422 invalid_request; 4422"))
    table.append(("7 Host", "Host: attacker.example", "400 host_not_allowed"))
    table.append(("7 Origin", "WebSocket Origin: https://attacker.example", "close 4403"))
    table.append(("7 realtime", "priority realtime without the grant", "403 priority_not_allowed"))

    # Nothing lost, no neighbour harmed: every job answered 202 succeeds, the neighbour's included.
    ended = {job_id: wait(who, job_id, timeout_s=120)["status"] for who, job_id in accepted}
    assert set(ended.values()) == {"succeeded"}, ended
    assert ended[neighbour.json()["id"]] == "succeeded"
    print(f"\n{len(accepted)} jobs accepted, {len(accepted)} succeeded")
    for row in table:
        print(" | ".join(row))
