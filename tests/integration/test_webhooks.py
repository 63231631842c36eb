"""Webhooks end to end: a real stack (`conveyor up`: api, batcher, stage worker, webhook dispatcher,
callbacks worker) posting to a real HTTP receiver in this process, on 127.0.0.2 (allow-listed for the
stack by CONVEYOR_WEBHOOK_ALLOW_CIDRS; 127.0.0.1 stays refused). Plus the dispatcher's cursor rules
on the real Redis, with the clock passed in."""

from __future__ import annotations

import base64
import http.server
import json
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
from harness import Harness, start_harness
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from app.core.config import Settings
from app.core.keys import Keys
from app.webhooks import delivery, signing
from app.webhooks.dispatcher import Dispatcher

SECRET = "whsec_" + base64.b64encode(b"conveyor-webhook-test-secret-32b").decode()
RECEIVER_HOST = "127.0.0.2"
BACKOFF_BASE_S = 0.4


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: str
    at: float
    status: int


class Receiver(http.server.ThreadingHTTPServer):
    """Answers by path: /ok/* 200, /flaky/* 500 three times then 200, /gone/* 410."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__((RECEIVER_HOST, 0), _Handler)
        self.received: list[Received] = []
        self.lock = threading.Lock()

    @property
    def base(self) -> str:
        return f"http://{RECEIVER_HOST}:{self.server_address[1]}"

    def answer(self, path: str) -> int:
        if path.startswith("/gone/"):
            return 410
        if path.startswith("/flaky/"):
            return 500 if sum(1 for r in self.received if r.path == path) < 3 else 200
        return 200

    def at(self, path: str) -> list[Received]:
        with self.lock:
            return [r for r in self.received if r.path == path]


class _Handler(http.server.BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:  # noqa: N802
        body = self.rfile.read(int(self.headers.get("content-length") or 0)).decode()
        with self.server.lock:
            status = self.server.answer(self.path)
            headers = {k.lower(): v for k, v in self.headers.items()}
            self.server.received.append(Received(self.path, headers, body, time.time(), status))
        self.send_response(status)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    server = Receiver()
    # A short poll: `shutdown()` waits for the loop to look (0.5 s by default, per test).
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def hooks_stack(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, tiny_model: Path
) -> Iterator[Harness]:
    backoff = mock.patch.object(delivery, "BACKOFF_BASE_S", BACKOFF_BASE_S)
    backoff.start()
    s = start_harness(
        tmp_path_factory.mktemp("webhooks"),
        redis_url=redis_url,
        models={"tiny": tiny_model},
        default_model="tiny",
        extra_env={
            "CONVEYOR_TORCH_THREADS": "1",
            "CONVEYOR_WEBHOOK_SECRETS": json.dumps([SECRET]),
            "CONVEYOR_WEBHOOK_ALLOW_CIDRS": json.dumps([f"{RECEIVER_HOST}/32"]),
            # One delivery at a time: the 410 test needs the first answer in before the next request.
            "CONVEYOR_WEBHOOK_CONCURRENCY": "1",
        },
    )
    yield s
    s.stop()
    backoff.stop()


def submit(stack: Harness, **body: object) -> dict[str, object]:
    with stack.client() as client:
        answer = client.post("/v1/jobs", json={"prompt": "Hello", "max_tokens": 8, "temperature": 0, **body})
    assert answer.status_code == 202, answer.text
    return answer.json()  # type: ignore[no-any-return]


def wait_for(predicate, timeout_s: float = 30.0, what: str = "") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def deliveries(stack: Harness, job_id: str) -> dict[str, object]:
    with stack.client() as client:
        answer = client.get(f"/v1/jobs/{job_id}/deliveries")
    assert answer.status_code == 200, answer.text
    return answer.json()  # type: ignore[no-any-return]


def test_deliveries_verify_with_the_reference_library(hooks_stack: Harness, receiver: Receiver) -> None:
    path = f"/ok/{uuid.uuid4().hex}"
    job = submit(
        hooks_stack,
        max_tokens=24,
        ignore_eos=True,
        callback_url=receiver.base + path,
        callback_events=["started", "token", "completed", "failed"],
    )

    def settled() -> bool:  # the completed event received, and every delivery received is in the log
        received = receiver.at(path)
        attempts: list[object] = deliveries(hooks_stack, str(job["id"]))["deliveries"]  # type: ignore[assignment]
        return any('"job.completed"' in r.body for r in received) and len(attempts) == len(received)

    wait_for(settled, what="the completed webhook, and the delivery log holding every request")
    got = receiver.at(path)
    verifier = Webhook(SECRET)
    payloads = [verifier.verify(r.body, r.headers) for r in got]  # raises if any does not verify
    kinds = [p["type"] for p in payloads]
    assert kinds.count("job.started") == 1 and kinds.count("job.completed") == 1 and "job.failed" not in kinds
    assert kinds.count("job.token") >= 1
    final = next(p for p in payloads if p["type"] == "job.completed")["data"]
    assert final["id"] == job["id"] and final["status"] == "succeeded"
    batches = sorted(
        (p["data"] for p in payloads if p["type"] == "job.token"), key=lambda d: d["tokens"][0]["index"]
    )
    indices = [t["index"] for d in batches for t in d["tokens"]]
    assert indices == list(range(24))  # every token once, in batches
    assert "".join(d["text"] for d in batches) == final["text"]
    assert len({r.headers["webhook-id"] for r in got}) == len(got)

    sample = got[-1]
    with pytest.raises(WebhookVerificationError):  # a changed body
        verifier.verify(sample.body.replace("succeeded", "failed"), sample.headers)
    with pytest.raises(WebhookVerificationError):  # a wrong secret
        Webhook("whsec_" + base64.b64encode(b"w" * 32).decode()).verify(sample.body, sample.headers)
    stale = dict(sample.headers, **{"webhook-timestamp": str(int(sample.headers["webhook-timestamp"]) - 301)})
    with pytest.raises(WebhookVerificationError):  # a timestamp moved more than 5 minutes
        verifier.verify(sample.body, stale)
    # and a correct signature made 5 minutes and a second ago is refused as stale
    old = int(time.time()) - 301
    resigned = signing.headers(
        sample.headers["webhook-id"], old, sample.body.encode(), [signing.Secret.parse(SECRET)]
    )
    with pytest.raises(WebhookVerificationError, match="too old"):
        verifier.verify(sample.body, resigned)

    log = deliveries(hooks_stack, str(job["id"]))
    assert log["callback_url"] == receiver.base + path and log["endpoint_disabled"] is False
    attempts = log["deliveries"]
    assert isinstance(attempts, list) and len(attempts) == len(got)
    assert {a["outcome"] for a in attempts} == {"delivered"} and {a["status_code"] for a in attempts} == {200}


def test_a_failing_receiver_gets_the_event_again_with_growing_backoff(
    hooks_stack: Harness, receiver: Receiver
) -> None:
    path = f"/flaky/{uuid.uuid4().hex}"
    job = submit(hooks_stack, callback_url=receiver.base + path, callback_events=["completed"])
    wait_for(lambda: len(receiver.at(path)) >= 4, what="four attempts")
    time.sleep(4 * BACKOFF_BASE_S)  # room for a fifth attempt, which must not come
    got = receiver.at(path)
    assert [r.status for r in got] == [500, 500, 500, 200]
    assert len({r.headers["webhook-id"] for r in got}) == 1  # the same event each time
    assert len({r.body for r in got}) == 1
    for r in got:
        Webhook(SECRET).verify(r.body, r.headers)

    attempts = deliveries(hooks_stack, str(job["id"]))["deliveries"]
    assert isinstance(attempts, list)
    assert [a["attempt"] for a in attempts] == [1, 2, 3, 4]
    assert [a["status_code"] for a in attempts] == [500, 500, 500, 200]
    assert [a["outcome"] for a in attempts] == ["retrying", "retrying", "retrying", "delivered"]
    delays = [a["retry_in_s"] for a in attempts[:3]]
    assert delays[0] < delays[1] < delays[2], delays  # exponential, jittered within [d/2, d]
    assert BACKOFF_BASE_S / 2 <= delays[0] <= BACKOFF_BASE_S
    assert attempts[3]["retry_in_s"] is None
    gaps = [b["at"] - a["at"] for a, b in zip(attempts, attempts[1:], strict=False)]
    assert all(gap >= delay - 0.05 for gap, delay in zip(gaps, delays, strict=True)), (gaps, delays)


def test_a_410_disables_the_endpoint(hooks_stack: Harness, receiver: Receiver) -> None:
    path = f"/gone/{uuid.uuid4().hex}"
    url = receiver.base + path
    job = submit(
        hooks_stack,
        max_tokens=16,
        ignore_eos=True,
        callback_url=url,
        callback_events=["started", "token", "completed"],
    )

    def settled() -> bool:
        attempts = deliveries(hooks_stack, str(job["id"]))["deliveries"]
        return any(a["type"] == "completed" for a in attempts)  # type: ignore[attr-defined]

    wait_for(settled, what="the completed event to be settled")
    time.sleep(0.5)
    assert [r.status for r in receiver.at(path)] == [410]  # one request, then nothing more
    log = deliveries(hooks_stack, str(job["id"]))
    attempts = log["deliveries"]
    assert isinstance(attempts, list) and len(attempts) >= 3  # started, a token batch or more, completed
    assert [a["outcome"] for a in attempts] == ["disabled"] + ["skipped"] * (len(attempts) - 1)
    assert attempts[0]["status_code"] == 410 and log["endpoint_disabled"] is True

    with hooks_stack.client() as client:  # and a new job cannot name it
        answer = client.post("/v1/jobs", json={"prompt": "Hello", "max_tokens": 4, "callback_url": url})
    assert answer.status_code == 422
    assert answer.json()["error"]["code"] == "callback_url_refused"
    assert answer.json()["error"]["details"]["reason"] == "endpoint_disabled"


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("http://127.0.0.1:9/hook", "loopback"),
        ("http://[::1]/hook", "loopback"),
        ("http://169.254.169.254/latest/meta-data/", "link_local"),
        ("http://10.0.0.1/", "private"),
        ("http://2130706433/", "loopback"),
        ("http://[::ffff:10.0.0.1]/", "private"),
        ("ftp://example.com/", "scheme"),
    ],
)
def test_internal_callback_urls_are_refused_at_submit(hooks_stack: Harness, url: str, reason: str) -> None:
    with hooks_stack.client() as client:
        answer = client.post("/v1/jobs", json={"prompt": "Hello", "max_tokens": 4, "callback_url": url})
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert error["code"] == "callback_url_refused" and error["details"]["reason"] == reason
    assert error["message"]


def test_callback_events_without_a_url_is_invalid(hooks_stack: Harness) -> None:
    with hooks_stack.client() as client:
        answer = client.post("/v1/jobs", json={"prompt": "Hello", "callback_events": ["completed"]})
        unknown = client.post(
            "/v1/jobs",
            json={"prompt": "Hello", "callback_url": "http://x.example/", "callback_events": ["bogus"]},
        )
        missing = client.get("/v1/jobs/nope/deliveries")
    assert answer.status_code == 422 and answer.json()["error"]["code"] == "invalid_request"
    assert unknown.status_code == 422 and unknown.json()["error"]["code"] == "invalid_request"
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "job_not_found"


# The dispatcher alone, on the real Redis: cursors, restarts and token batches (clock passed in).


def _record(keys: Keys, redis, job_id: str, events: list[str]) -> None:  # type: ignore[no-untyped-def]
    redis.hset(
        keys.job(job_id),
        mapping={
            "id": job_id,
            "status": "succeeded",
            "model": "tiny",
            "tenant": "t",
            "priority": "normal",
            "text": "Hi!",
            "prompt_tokens": "2",
            "completion_tokens": "2",
            "created_at": "1.0",
            "callback_url": "https://hooks.example/x",
            "callback_events": json.dumps(events),
        },
    )
    redis.expire(keys.job(job_id), 600)
    redis.zadd(keys.webhook_jobs(), {job_id: time.time()})


def _token(redis, keys: Keys, job_id: str, index: int, text: str) -> str:  # type: ignore[no-untyped-def]
    data = json.dumps({"index": index, "text": text, "token_id": index})
    return redis.xadd(keys.events(job_id), {"event": "token", "data": data}).decode()  # type: ignore[no-any-return]


def test_the_dispatcher_resumes_from_its_cursor_and_batches_tokens(redis, redis_url: str) -> None:  # type: ignore[no-untyped-def]
    settings = Settings(namespace=f"test-{uuid.uuid4().hex[:8]}", redis_url=redis_url)
    keys = Keys(settings.namespace)
    job_id = uuid.uuid4().hex
    _record(keys, redis, job_id, ["started", "token", "completed"])
    sent: list[dict[str, object]] = []
    now = [100.0]
    first = Dispatcher(
        redis, keys, settings.webhook, sent.append, job_ttl_s=settings.job_ttl_s, clock=lambda: now[0]
    )
    t0 = _token(redis, keys, job_id, 0, "H")
    _token(redis, keys, job_id, 1, "i")
    first.step()
    assert [m["webhook_id"] for m in sent] == [f"msg_{job_id}_started"]  # tokens held for their batch
    assert redis.hget(keys.webhook_cursors(), job_id) is None  # the held tokens are re-read after a restart

    # the first one died
    restarted = Dispatcher(
        redis, keys, settings.webhook, sent.append, job_ttl_s=settings.job_ttl_s, clock=lambda: now[0]
    )
    restarted.step()
    assert [m["webhook_id"] for m in sent][-1] == f"msg_{job_id}_started"  # the same id: skipped on delivery
    now[0] += 0.5
    restarted.step()
    token = sent[-1]
    assert token["webhook_id"] == f"msg_{job_id}_token_{t0}"
    assert json.loads(str(token["body"]))["data"]["text"] == "Hi"
    cursor = redis.hget(keys.webhook_cursors(), job_id).decode()
    assert cursor != t0  # past both tokens

    t2 = _token(redis, keys, job_id, 2, "!")
    redis.xadd(keys.events(job_id), {"event": "done", "data": "{}"})
    count = len(sent)
    again = Dispatcher(
        redis, keys, settings.webhook, sent.append, job_ttl_s=settings.job_ttl_s, clock=lambda: now[0]
    )
    again.step()
    tail = sent[count:]
    assert [m["type"] for m in tail] == ["token", "completed"]  # the rest only, the batch before the end
    assert tail[0]["webhook_id"] == f"msg_{job_id}_token_{t2}"
    assert json.loads(str(tail[1]["body"]))["data"]["text"] == "Hi!"
    assert tail[1]["url"] == "https://hooks.example/x"
    assert redis.zscore(keys.webhook_jobs(), job_id) is None  # done: no longer followed
    assert redis.hget(keys.webhook_cursors(), job_id) is None
    redis.delete(keys.job(job_id), keys.events(job_id))
