"""One tenant cannot block webhook delivery for the others: an attempt has one wall-clock deadline
(a receiver that never answers, or trickles a byte at a time, holds its thread no longer), a tenant
has at most `delivery.TENANT_CONCURRENCY` deliveries in progress (the rest wait in Redis, not in a
thread), and retries wait in Redis, where a restarted worker finds them.

Real receivers on loopback (allow-listed), the real delivery code and dispatcher, a real Redis; the
callbacks worker's thread pool as a ThreadPoolExecutor of the same size."""

from __future__ import annotations

import base64
import http.server
import json
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from app.core.config import Settings
from app.core.keys import Keys
from app.webhooks import delivery, retries
from app.webhooks.delivery import Deliverer
from app.webhooks.dispatcher import Dispatcher
from app.webhooks.signing import SecretBook
from app.webhooks.ssrf import Guard
from tests.tinyapi import forget_keys

SECRET = "whsec_" + base64.b64encode(b"delivery-bounds-test-secret-32by").decode()
DEADLINE_S = 1.0
TRICKLE_S = 0.25  # between two bytes of a trickling answer: well inside any per-read timeout


class SlowServer:
    """A TCP server on loopback that accepts and then never answers (`mode="hang"`) or sends an HTTP
    response one byte every TRICKLE_S, never finishing its headers (`mode="trickle"`)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.accepted = threading.Event()
        self.stop = threading.Event()
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}/hook"

    def _serve(self) -> None:
        self.sock.settimeout(0.2)
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.conns.append(conn)
            self.accepted.set()
            if self.mode == "trickle":
                threading.Thread(target=self._trickle, args=(conn,), daemon=True).start()

    def _trickle(self, conn: socket.socket) -> None:
        for byte in b"HTTP/1.1 200 OK\r\nx-slow: " + b"a" * 120:
            if self.stop.wait(TRICKLE_S):
                return
            try:
                conn.send(bytes([byte]))
            except OSError:
                return

    def close(self) -> None:
        self.stop.set()
        for conn in self.conns:
            conn.close()
        self.sock.close()


class Receiver(http.server.ThreadingHTTPServer):
    """/fail-once/*: 500 the first time, then 200; anything else 200. Keeps each request's arrival time."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.received: list[tuple[str, float, int]] = []
        self.lock = threading.Lock()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}{path}"

    def at(self, path: str) -> list[tuple[str, float, int]]:
        with self.lock:
            return [r for r in self.received if r[0] == path]


class _Handler(http.server.BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("content-length") or 0))
        with self.server.lock:
            seen = sum(1 for r in self.server.received if r[0] == self.path)
            status = 500 if self.path.startswith("/fail-once/") and seen == 0 else 200
            self.server.received.append((self.path, time.monotonic(), status))
        self.send_response(status)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def receiver() -> Iterator[Receiver]:
    server = Receiver()
    # A short poll: `shutdown()` waits for the loop to look (0.5 s by default, per test).
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture()
def settings(redis, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Settings]:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(delivery, "ATTEMPT_DEADLINE_S", DEADLINE_S)
    monkeypatch.setattr(delivery, "BACKOFF_BASE_S", 0.2)
    monkeypatch.setattr(delivery, "BACKOFF_MAX_S", 0.4)
    monkeypatch.setattr(delivery, "TENANT_CONCURRENCY", 1)
    config = Settings(
        redis_url=redis_url,
        namespace=f"test-{uuid.uuid4().hex[:8]}",
        webhook_secrets=[SECRET],
        webhook_allow_cidrs=["127.0.0.1/32"],
    )
    yield config
    keys = Keys(config.namespace)
    forget_keys(redis, config.namespace)
    assert keys.namespace.startswith("test-")


def deliverer(redis, settings: Settings) -> Deliverer:  # type: ignore[no-untyped-def]
    guard = Guard(settings.webhook.allow_cidrs)
    keys = Keys(settings.namespace)
    return Deliverer(
        redis,
        keys,
        settings.webhook,
        guard=guard,
        secrets=SecretBook([SECRET]),
        job_ttl_s=settings.job_ttl_s,
    )


def message(url: str, tenant: str) -> dict[str, object]:
    job_id = uuid.uuid4().hex
    body = json.dumps({"type": "job.completed", "timestamp": "2026-01-01T00:00:00Z", "data": {"id": job_id}})
    return {
        "job_id": job_id,
        "webhook_id": f"msg_{job_id}_completed",
        "type": "completed",
        "url": url,
        "tenant": tenant,
        "body": body,
    }


def log_of(redis, settings: Settings, job_id: object) -> list[dict[str, object]]:  # type: ignore[no-untyped-def]
    raw = redis.lrange(Keys(settings.namespace).webhook_deliveries(str(job_id)), 0, -1)
    return [json.loads(r) for r in raw]


@pytest.mark.parametrize("mode", ["hang", "trickle"])
def test_a_slow_receiver_holds_a_delivery_for_the_deadline_at_most(redis, settings, mode) -> None:  # type: ignore[no-untyped-def]
    server = SlowServer(mode)
    try:
        d = deliverer(redis, settings)
        event = message(server.url, "slow-tenant")
        started = time.monotonic()
        d.deliver(event)
        took = time.monotonic() - started
    finally:
        server.close()
    assert server.accepted.is_set()
    assert took < DEADLINE_S + 0.75, f"{mode}: the attempt took {took:.2f} s"
    (attempt,) = log_of(redis, settings, event["job_id"])
    assert attempt["outcome"] == "retrying" and "Timeout" in str(attempt["error"]), attempt
    assert d.slots.held("slow-tenant", now=time.time()) == 0  # the slot is free again
    assert redis.zscore(Keys(settings.namespace).webhook_retries(), str(event["webhook_id"])) is not None


def test_a_hanging_tenant_does_not_stop_another_tenants_deliveries(  # type: ignore[no-untyped-def]
    redis, settings, receiver, monkeypatch
) -> None:
    # A's attempt hangs far longer than the test: B delivered while it still hangs did not wait behind it.
    monkeypatch.setattr(delivery, "ATTEMPT_DEADLINE_S", 120.0)
    hanging = SlowServer("hang")
    d = deliverer(redis, settings)
    pool = ThreadPoolExecutor(max_workers=2)  # the callbacks worker's threads, fewer than A's events
    try:
        a_events = [message(hanging.url, "tenant-a") for _ in range(4)]
        futures = [pool.submit(d.deliver, e) for e in a_events]
        assert hanging.accepted.wait(30)
        b_event = message(receiver.url("/b"), "tenant-b")
        pool.submit(d.deliver, b_event).result(timeout=60)
        b_got = receiver.at("/b")
        assert len(b_got) == 1 and b_got[0][2] == 200
        ended = [e for e in a_events if log_of(redis, settings, e["job_id"])]
        assert ended == [], "tenant B waited behind tenant A's hanging receiver"
        hanging.close()  # A's attempt ends (the receiver hangs up), and it is retried from Redis
        for f in futures:
            f.result(timeout=60)
    finally:
        pool.shutdown(wait=True)
        hanging.close()
    assert len(hanging.conns) == 1  # one attempt of A's at a time (its cap); the others waited in Redis
    keys = Keys(settings.namespace)
    waiting = {m.decode() for m in redis.zrange(keys.webhook_retries(), 0, -1)}
    assert waiting == {str(e["webhook_id"]) for e in a_events}  # the hung one's retry and three waiting
    # one of A's events was attempted (and hung); the other three were never attempted, only deferred
    assert sorted(len(log_of(redis, settings, e["job_id"])) for e in a_events) == [0, 0, 0, 1]
    assert [a["outcome"] for a in log_of(redis, settings, b_event["job_id"])] == ["delivered"]


def test_a_tenant_has_a_bounded_number_of_waiting_retries(redis, redis_url, settings, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(retries, "TENANT_MAX_RETRIES", 2)
    capped = settings
    refused = f"http://127.0.0.1:{_closed_port()}/hook"  # connection refused: each attempt fails at once
    d = deliverer(redis, capped)
    events = [message(refused, "tenant-a") for _ in range(3)]
    for e in events:
        d.deliver(e)
    outcomes = [[a["outcome"] for a in log_of(redis, capped, e["job_id"])] for e in events]
    assert outcomes[:2] == [["retrying"], ["retrying"]]
    assert outcomes[2] == ["retrying", "gave_up"]  # the third retry would pass the cap: given up
    assert d.retries.waiting("tenant-a") == 2


def test_retries_wait_in_redis_and_survive_a_worker_restart(redis, settings, receiver) -> None:  # type: ignore[no-untyped-def]
    keys = Keys(settings.namespace)
    event = message(receiver.url("/fail-once/x"), "tenant-a")
    first = deliverer(redis, settings)
    first.deliver(event)  # 500: the retry goes to Redis
    assert [r[2] for r in receiver.at("/fail-once/x")] == [500]
    assert redis.zscore(keys.webhook_retries(), str(event["webhook_id"])) is not None
    del first  # the worker that made the attempt is gone, and its memory with it

    restarted = deliverer(redis, settings)
    dispatcher = Dispatcher(
        redis,
        keys,
        settings.webhook,
        restarted.deliver,
        job_ttl_s=settings.job_ttl_s,
        clock=lambda: time.time() + 60,
    )
    assert dispatcher.send_due_retries() == 1
    assert [r[2] for r in receiver.at("/fail-once/x")] == [500, 200]
    attempts = log_of(redis, settings, event["job_id"])
    assert [(a["attempt"], a["outcome"]) for a in attempts] == [(1, "retrying"), (2, "delivered")]
    assert redis.zcard(keys.webhook_retries()) == 0 and dispatcher.send_due_retries() == 0
    assert restarted.retries.waiting("tenant-a") == 0


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
