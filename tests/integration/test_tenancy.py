"""Auth, tenants, rate limits, audit and TLS over the network, on one stack started with credentials
(API keys in Redis, an RS256 JWT key, per-tenant limits, prompts audited).

- who may call: no credentials, bad API keys and every refused JWT are 401 with WWW-Authenticate;
  a valid RS256 token is 202; health and docs stay open;
- isolation: tenant B cannot read, stream (SSE or WebSocket), cancel or list the deliveries of
  tenant A's job (404, as for an unknown job), nor reach it through A's Idempotency-Key;
- rate limits through HTTP: three clients of one tenant at 10x its limit, another tenant unaffected;
- the audit stream: one entry per request with its fields;
- request body size: 413 on Content-Length and on a chunked body;
- TLS: `conveyor api --ssl-certfile/--ssl-keyfile` answers /healthz over https, and refuses a
  client that offers nothing newer than TLS 1.2 (1.3 at least).
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import hmac
import ipaddress
import json
import os
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jwt
import pytest
import redis as redis_lib
from clients import events, wait
from conftest import ROOT, free_port
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID
from harness import Harness, start_harness
from websockets.exceptions import ConnectionClosedError
from websockets.sync.client import connect

from app.api.auth import key_digest, new_api_key
from app.core.keys import Keys

AUD, ISS = "conveyor-api", "https://issuer.example"
KEY_A, KEY_LIMITED, KEY_TOKENS = new_api_key(), new_api_key(), new_api_key()
LIMITED_RPS, LIMITED_BURST = 2.0, 4
JOB = {"prompt": "x", "max_tokens": 1, "temperature": 0}


@pytest.fixture(scope="module")
def signer() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def public_pem(key: rsa.RSAPrivateKey) -> str:
    return (
        key.public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        .decode()
    )


@pytest.fixture(scope="module")
def secured(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, tiny_model: Path, signer: rsa.RSAPrivateKey
) -> Iterator[Harness]:
    stack = start_harness(
        tmp_path_factory.mktemp("tenancy"),
        redis_url=redis_url,
        models={"tiny": tiny_model},
        default_model="tiny",
        extra_env={
            "CONVEYOR_TORCH_THREADS": "1",
            "CONVEYOR_JWT_KEY": public_pem(signer),
            "CONVEYOR_JWT_AUDIENCE": AUD,
            "CONVEYOR_JWT_ISSUER": ISS,
            "CONVEYOR_RATE_LIMITS": json.dumps(
                {"limited": {"rps": LIMITED_RPS, "burst": LIMITED_BURST}, "tokens": {"tokens_per_min": 60}}
            ),
            "CONVEYOR_AUDIT_PROMPTS": "true",
        },
    )
    # Stored as `conveyor keys create` stores a key (tenant B's is made by the command itself): keys
    # in CONVEYOR_API_KEYS would be the whole list, and Redis's not checked.
    stored = redis_lib.Redis.from_url(redis_url)
    for key, tenant in ((KEY_A, "tenant-a"), (KEY_LIMITED, "limited"), (KEY_TOKENS, "tokens")):
        record = json.dumps({"tenant": tenant, "created_at": time.time()})
        stored.hset(Keys(stack.namespace).api_keys(), key_digest(key), record)
    yield stack
    stack.stop()


def cli(stack: Harness, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env.update({"REDIS_URL": stack.redis_url or "", "CONVEYOR_NAMESPACE": stack.namespace})
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture(scope="module")
def key_b(secured: Harness) -> str:
    """Tenant B's key, made as an operator makes one: `conveyor keys create` (stored hashed in Redis)."""
    made = cli(secured, "keys", "create", "--tenant", "tenant-b")
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip()
    assert key.startswith("cvk_")
    stored = redis_lib.Redis.from_url(secured.redis_url or "").hgetall(Keys(secured.namespace).api_keys())
    assert json.loads(stored[key_digest(key).encode()])["tenant"] == "tenant-b"  # only the hash is kept
    assert not any(key.encode() in k + v for k, v in stored.items())
    return key


def as_a(stack: Harness) -> httpx.Client:
    return stack.client(headers={"Authorization": f"Bearer {KEY_A}"})


def as_b(stack: Harness, key_b: str) -> httpx.Client:
    return stack.client(headers={"X-API-Key": key_b})


def token(signer: rsa.RSAPrivateKey, **overrides: Any) -> str:
    now = int(time.time())
    claims: dict[str, Any] = {"sub": "jwt-tenant", "aud": AUD, "iss": ISS, "iat": now, "exp": now + 300}
    claims.update(overrides)
    claims = {k: v for k, v in claims.items() if v is not None}
    private = signer.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return jwt.encode(claims, private, algorithm="RS256")


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


# --- who may call --------------------------------------------------------------------------------


def test_health_and_docs_stay_open(secured):  # type: ignore[no-untyped-def]
    with secured.client() as client:
        # What docs/security.md lists as open: probes, metrics, the schema and its viewers, the playground.
        probes = ("/health", "/healthz", "/readyz", "/metrics")
        for path in (*probes, "/openapi.json", "/docs", "/redoc", "/playground"):
            assert client.get(path).status_code == 200, path
        schemes = client.get("/openapi.json").json()["components"]["securitySchemes"]
    assert {s["type"] for s in schemes.values()} == {"http", "apiKey"}


@pytest.mark.parametrize(
    ("method", "path", "headers"),
    [
        ("POST", "/v1/jobs", {}),
        ("GET", "/v1/jobs/0123456789abcdef0123456789abcdef", {}),
        ("GET", "/v1/models", {}),
        ("POST", "/v1/jobs", {"Authorization": "Bearer cvk_not-a-key"}),
        ("POST", "/v1/jobs", {"X-API-Key": "cvk_not-a-key"}),
        ("POST", "/v1/jobs", {"Authorization": "Basic dXNlcjpwYXNz"}),
    ],
)
def test_without_valid_credentials_is_401(secured, method, path, headers):  # type: ignore[no-untyped-def]
    with secured.client() as client:
        answer = client.request(method, path, json=JOB if method == "POST" else None, headers=headers)
    assert answer.status_code == 401, answer.text
    assert answer.headers["www-authenticate"].startswith('Bearer realm="conveyor"')
    error = answer.json()["error"]
    assert error["code"] == "unauthorized" and error["message"]


def test_the_openai_routes_add_their_error_type_to_a_401(secured):  # type: ignore[no-untyped-def]
    with secured.client() as client:
        answer = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert answer.status_code == 401
    assert answer.json()["error"]["type"] == "invalid_request_error"
    assert "www-authenticate" in answer.headers


@pytest.mark.parametrize(
    "attack",
    ["alg_none", "hs256_with_public_key", "expired", "nbf_future", "wrong_aud", "wrong_iss", "no_exp"],
)
def test_refused_tokens_are_401(secured, signer, attack):  # type: ignore[no-untyped-def]
    now = int(time.time())
    claims = {"sub": "jwt-tenant", "aud": AUD, "iss": ISS, "exp": now + 300}
    head_none = (
        f"{b64(json.dumps({'alg': 'none', 'typ': 'JWT'}).encode())}.{b64(json.dumps(claims).encode())}"
    )
    head_hs = f"{b64(json.dumps({'alg': 'HS256', 'typ': 'JWT'}).encode())}.{b64(json.dumps(claims).encode())}"
    confused = hmac.new(public_pem(signer).encode(), head_hs.encode(), hashlib.sha256).digest()
    bad = {
        "alg_none": f"{head_none}.",
        "hs256_with_public_key": f"{head_hs}.{b64(confused)}",
        "expired": lambda: token(signer, exp=now - 3600, iat=now - 7200),
        "nbf_future": lambda: token(signer, nbf=now + 3600),
        "wrong_aud": lambda: token(signer, aud="other-api"),
        "wrong_iss": lambda: token(signer, iss="https://evil.example"),
        "no_exp": lambda: token(signer, exp=None),
    }[attack]
    value = bad() if callable(bad) else bad
    with secured.client() as client:
        answer = client.post("/v1/jobs", json=JOB, headers={"Authorization": f"Bearer {value}"})
    assert answer.status_code == 401, answer.text
    assert answer.json()["error"]["code"] == "unauthorized"
    assert 'error="invalid_token"' in answer.headers["www-authenticate"]


def test_a_valid_rs256_token_is_202_and_owns_its_job(secured, signer, redis):  # type: ignore[no-untyped-def]
    with secured.client(headers={"Authorization": f"Bearer {token(signer)}"}) as client:
        answer = client.post("/v1/jobs", json=JOB)
        assert answer.status_code == 202, answer.text
        job_id = answer.json()["id"]
        assert wait(client, job_id)["status"] == "succeeded"
    assert redis.hget(Keys(secured.namespace).job(job_id), "tenant") == b"jwt:jwt-tenant"
    with as_a(secured) as other:
        assert other.get(f"/v1/jobs/{job_id}").status_code == 404


def test_a_revoked_key_is_refused_at_once(secured):  # type: ignore[no-untyped-def]
    made = cli(secured, "keys", "create", "--tenant", "short-lived")
    key = made.stdout.strip()
    with secured.client(headers={"X-API-Key": key}) as client:
        assert client.post("/v1/jobs", json=JOB).status_code == 202
        assert cli(secured, "keys", "revoke", key).returncode == 0
        assert client.post("/v1/jobs", json=JOB).status_code == 401


# --- isolation -----------------------------------------------------------------------------------


def test_another_tenants_job_does_not_exist_for_you(secured, key_b):  # type: ignore[no-untyped-def]
    with as_a(secured) as a, as_b(secured, key_b) as b:
        running = a.post("/v1/jobs", json={**JOB, "max_tokens": 200, "ignore_eos": True}).json()
        job_id = running["id"]
        for method, path in [
            ("GET", f"/v1/jobs/{job_id}"),
            ("GET", f"/v1/jobs/{job_id}/events"),
            ("POST", f"/v1/jobs/{job_id}/cancel"),
            ("GET", f"/v1/jobs/{job_id}/deliveries"),
        ]:
            answer = b.request(method, path)
            assert answer.status_code == 404, (path, answer.text)
            unknown = b.request(method, path.replace(job_id, "0" * 32))
            # Word for word what a job that does not exist gets: nothing tells B that A's job exists.
            assert answer.json() == json.loads(unknown.text.replace("0" * 32, job_id))
            assert answer.json()["error"]["code"] == "job_not_found"
        ws_url = f"{secured.url.replace('http://', 'ws://', 1)}/v1/jobs/{job_id}/ws"
        with (
            connect(ws_url, open_timeout=30, additional_headers={"X-API-Key": key_b}) as ws,
            pytest.raises(ConnectionClosedError),
        ):
            ws.recv(timeout=30)
        assert ws.close_code == 4404 and ws.close_reason.startswith("job_not_found")
        with connect(ws_url, open_timeout=30) as ws, pytest.raises(ConnectionClosedError):
            ws.recv(timeout=30)
        assert ws.close_code == 4401 and ws.close_reason.startswith("unauthorized")
        # B's attempts changed nothing: A's job runs to its end, and A reads all of it.
        assert a.get(f"/v1/jobs/{job_id}/deliveries").status_code == 200
        assert events(a, running["urls"]["events"])[-1].event == "done"
        assert wait(a, job_id)["status"] == "succeeded"


def test_idempotency_keys_are_per_tenant(secured, key_b):  # type: ignore[no-untyped-def]
    key = {"Idempotency-Key": f"order-{time.time_ns()}"}
    with as_a(secured) as a, as_b(secured, key_b) as b:
        mine = a.post("/v1/jobs", json=JOB, headers=key)
        theirs = b.post("/v1/jobs", json=JOB, headers=key)
        again = b.post("/v1/jobs", json=JOB, headers=key)
    assert mine.status_code == theirs.status_code == again.status_code == 202
    assert mine.json()["id"] != theirs.json()["id"] == again.json()["id"]
    assert "idempotent-replayed" not in theirs.headers and again.headers["idempotent-replayed"] == "true"


# --- rate limits through the API -----------------------------------------------------------------


def test_three_clients_at_ten_times_a_tenants_limit(secured):  # type: ignore[no-untyped-def]
    seconds = 3.0
    per_client = LIMITED_RPS * 10 / 3
    start = threading.Barrier(4)

    def hammer(key: str, per_second: float) -> list[httpx.Response]:
        out = []
        with secured.client(headers={"X-API-Key": key}) as client:
            client.get("/healthz")
            start.wait()
            until = time.monotonic() + seconds
            while time.monotonic() < until:
                sent = time.monotonic()
                out.append(client.post("/v1/jobs", json=JOB))
                time.sleep(max(0.0, 1 / per_second - (time.monotonic() - sent)))
        return out

    began = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        limited = [pool.submit(hammer, KEY_LIMITED, per_client) for _ in range(3)]
        other = pool.submit(hammer, KEY_A, 4.0)
        answers = [r for f in limited for r in f.result()]
        others = other.result()
    elapsed = time.monotonic() - began
    admitted = [r for r in answers if r.status_code == 202]
    refused = [r for r in answers if r.status_code == 429]
    assert len(admitted) + len(refused) == len(answers)  # nothing else
    assert len(answers) / elapsed >= 5 * LIMITED_RPS  # 10x offered; at least 5x even on a slow machine
    assert len(admitted) <= (LIMITED_RPS * elapsed + LIMITED_BURST) * 1.01
    assert len(admitted) >= LIMITED_BURST
    for r in refused:
        assert (
            r.json()["error"]["code"] == "rate_limited"
            and r.json()["error"]["details"]["limit"] == "requests"
        )
        assert int(r.headers["retry-after"]) >= 1
        assert r.headers["ratelimit-limit"] == str(LIMITED_BURST) and r.headers["ratelimit-remaining"] == "0"
        assert int(r.headers["ratelimit-reset"]) >= 1
    assert all("ratelimit-remaining" in r.headers for r in admitted)
    assert {r.status_code for r in others} == {202}  # another tenant is unaffected
    with secured.client(headers={"X-API-Key": KEY_LIMITED}) as client:
        for r in admitted:
            wait(client, r.json()["id"])


def test_a_token_limit_charges_max_tokens(secured):  # type: ignore[no-untyped-def]
    with secured.client(headers={"X-API-Key": KEY_TOKENS}) as client:
        first = client.post("/v1/jobs", json={**JOB, "max_tokens": 40})
        assert first.status_code == 202 and first.headers["ratelimit-limit"] == "60"
        assert first.headers["ratelimit-remaining"] == "20"
        second = client.post("/v1/jobs", json={**JOB, "max_tokens": 40})
        assert second.status_code == 429 and second.json()["error"]["details"]["limit"] == "tokens"
        assert 15 <= int(second.headers["retry-after"]) <= 21  # 20 tokens short at one a second
        too_big = client.post("/v1/jobs", json={**JOB, "max_tokens": 61})
        assert too_big.status_code == 422 and too_big.json()["error"]["code"] == "max_tokens_exceeded"
        assert too_big.json()["error"]["details"]["limit"] == 60
        wait(client, first.json()["id"])


# --- request size --------------------------------------------------------------------------------


def test_a_body_over_the_limit_is_413(secured):  # type: ignore[no-untyped-def]
    big = json.dumps({"prompt": "x" * (1024 * 1024), "max_tokens": 1}).encode()
    with as_a(secured) as client:
        declared = client.post("/v1/jobs", content=big, headers={"content-type": "application/json"})
        chunked = client.post(
            "/v1/jobs",
            content=iter([big[i : i + 65536] for i in range(0, len(big), 65536)]),
            headers={"content-type": "application/json"},
        )
    for answer in (declared, chunked):
        assert answer.status_code == 413, answer.text
        error = answer.json()["error"]
        assert error["code"] == "payload_too_large" and "1048576" in error["message"]
        assert error["details"]["limit"] == 1048576
    assert "transfer-encoding" not in declared.request.headers
    assert chunked.request.headers["transfer-encoding"] == "chunked"


# --- the audit log -------------------------------------------------------------------------------


def test_one_audit_entry_per_request(secured, key_b, redis):  # type: ignore[no-untyped-def]
    stream, refused = Keys(secured.namespace).audit(), Keys(secured.namespace).audit_unauthenticated()
    last, last_refused = redis.xrevrange(stream, count=1), redis.xrevrange(refused, count=1)
    after = last[0][0].decode() if last else "0-0"
    after_refused = last_refused[0][0].decode() if last_refused else "0-0"
    sent: list[httpx.Request] = []
    hooks = {"request": [sent.append]}
    with secured.client(headers={"X-API-Key": KEY_A}, event_hooks=hooks) as a:
        job = a.post("/v1/jobs", json={"prompt": "audit me", "max_tokens": 2, "temperature": 0}).json()
        done = wait(a, job["id"])
        events(a, job["urls"]["events"])
    with secured.client() as nobody:  # refused before a tenant is known: in a stream of its own
        nobody.get(f"/v1/jobs/{job['id']}")
    with as_b(secured, key_b) as b:
        b.event_hooks = hooks
        b.get(f"/v1/jobs/{job['id']}")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        entries = redis.xrange(stream, min=f"({after}", max="+")
        refusals = redis.xrange(refused, min=f"({after_refused}", max="+")
        if len(entries) >= len(sent) and refusals:
            break
        time.sleep(0.05)
    rows = [{k.decode(): v.decode() for k, v in fields.items()} for _, fields in entries]
    assert len(rows) == len(sent)  # one per request, no more
    assert [(r["method"], r["path"]) for r in rows] == [(q.method, q.url.path) for q in sent]
    post, polls, stream_row, foreign = rows[0], rows[1:-2], rows[-2], rows[-1]
    unauthorized = [{k.decode(): v.decode() for k, v in fields.items()} for _, fields in refusals]
    assert [(r["method"], r["path"], r["status"], r["tenant"]) for r in unauthorized] == [
        ("GET", f"/v1/jobs/{job['id']}", "401", "")
    ]
    for row in rows:
        assert {"time", "tenant", "method", "path", "status", "duration_ms", "client"} <= set(row)
        assert float(row["duration_ms"]) >= 0 and row["client"].startswith("127.0.0.1:")
    assert post["tenant"] == "tenant-a" and post["status"] == "202" and post["job_id"] == job["id"]
    assert post["model"] == "tiny" and int(post["prompt_tokens"]) == done["usage"]["prompt_tokens"]
    assert post["prompt"] == "audit me"  # audit_prompts is on in this stack
    assert polls[-1]["completion_tokens"] == "2" and polls[-1]["status"] == "200"
    assert stream_row["completion_tokens"] == "2" and stream_row["path"].endswith("/events")
    assert foreign["status"] == "404" and foreign["tenant"] == "tenant-b" and foreign["job_id"] == job["id"]
    assert "completion_tokens" not in foreign  # nothing of A's job is written into B's entry


# --- TLS -----------------------------------------------------------------------------------------


def self_signed(tmp: Path) -> tuple[Path, Path]:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp / "cert.pem", tmp / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert_path, key_path


def handshake(
    port: int, cafile: Path, *, minimum: ssl.TLSVersion | None = None, maximum: ssl.TLSVersion | None = None
) -> str | None:
    """The TLS version a client limited to [minimum, maximum] agrees with the server, None if refused."""
    import socket

    context = ssl.create_default_context(cafile=str(cafile))
    if minimum is not None:
        context.minimum_version = minimum
    if maximum is not None:
        context.maximum_version = maximum
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        try:
            with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
                return tls.version()
        except ssl.SSLError:
            return None


def test_the_api_serves_https_with_the_given_certificate(tmp_path, redis_url, tiny_model):  # type: ignore[no-untyped-def]
    """`conveyor api` alone (what `conveyor up --ssl-*` starts as its api child; the argv plumbing is
    unit-tested): /healthz over https, verified against the self-signed certificate."""
    cert, key = self_signed(tmp_path)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env.update(
        {
            "REDIS_URL": redis_url,
            "CONVEYOR_NAMESPACE": f"test-tls-{port}",
            "CONVEYOR_API_PORT": str(port),
            "CONVEYOR_HOME": str(tmp_path / "home"),
            "CONVEYOR_MODELS": json.dumps({"tiny": str(tiny_model)}),
            "CONVEYOR_DEFAULT_MODEL": "tiny",
            "CONVEYOR_AUTH": "none",
        }
    )
    log = tmp_path / "api.log"
    argv = [sys.executable, "-m", "app.cli", "api", "--ssl-certfile", str(cert), "--ssl-keyfile", str(key)]
    process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    trusted = ssl.create_default_context(cafile=str(cert))
    try:
        deadline, answer = time.monotonic() + 60, None
        while time.monotonic() < deadline and answer is None:
            assert process.poll() is None, log.read_text()[-3000:]
            try:
                answer = httpx.get(f"https://127.0.0.1:{port}/healthz", verify=trusted, timeout=2)
            except httpx.TransportError:
                time.sleep(0.2)
        assert answer is not None and answer.status_code == 200, log.read_text()[-3000:]
        assert answer.json()["status"] == "ok"
        with pytest.raises(httpx.TransportError):  # and nothing in clear text on that port
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
        # TLS 1.3 at least: a client that stops at 1.2 fails the handshake.
        assert handshake(port, cert, maximum=ssl.TLSVersion.TLSv1_2) is None
        assert handshake(port, cert, minimum=ssl.TLSVersion.TLSv1_3) == "TLSv1.3"
        assert "NO AUTHENTICATION" in log.read_text()  # served without credentials: the loud line
    finally:
        process.terminate()
        process.wait(30)
