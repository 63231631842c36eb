"""Authentication rules without services: JWT verification (the attacks it must refuse), the JWT
settings it refuses to start with, API keys from settings, the audit entry, the TLS plumbing."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import ssl
import time
from pathlib import Path
from typing import Any

import jwt
import pytest
import typer
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from starlette.datastructures import Headers

from app.api import audit
from app.api.auth import Authenticator, JwtVerifier, key_digest, new_api_key
from app.cli import uvicorn_options
from app.cli_up import api_command
from app.core.config import Settings
from app.core.errors import RateLimited, Unauthorized
from app.core.keys import Keys

AUD, ISS = "conveyor-api", "https://issuer.example"


def _pem_private(key: rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _pem_public(key: rsa.RSAPrivateKey) -> str:
    return (
        key.public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        .decode()
    )


@pytest.fixture(scope="module")
def signer() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


@pytest.fixture(scope="module")
def settings(signer: rsa.RSAPrivateKey) -> Settings:
    return Settings(jwt_key=_pem_public(signer), jwt_algorithms=["RS256"], jwt_audience=AUD, jwt_issuer=ISS)


def claims(**overrides: Any) -> dict[str, Any]:
    now = int(time.time())
    out: dict[str, Any] = {"sub": "acme", "aud": AUD, "iss": ISS, "iat": now, "exp": now + 300}
    out.update(overrides)
    return {k: v for k, v in out.items() if v is not None}


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def unsigned(header: dict[str, Any], payload: dict[str, Any]) -> str:
    return f"{b64(json.dumps(header).encode())}.{b64(json.dumps(payload).encode())}"


def hs256_with(secret: bytes, payload: dict[str, Any]) -> str:
    """Signed by hand: PyJWT itself refuses to use a PEM key as an HMAC secret."""
    head = unsigned({"alg": "HS256", "typ": "JWT"}, payload)
    return f"{head}.{b64(hmac.new(secret, head.encode(), hashlib.sha256).digest())}"


def test_a_valid_rs256_token_names_its_tenant(signer, settings):  # type: ignore[no-untyped-def]
    verifier = JwtVerifier(settings.authenticator)
    assert verifier.tenant(jwt.encode(claims(), _pem_private(signer), algorithm="RS256")) == "jwt:acme"
    token = jwt.encode(claims(tenant="globex"), _pem_private(signer), algorithm="RS256")
    assert verifier.tenant(token) == "jwt:globex"  # `tenant` comes before `sub` in jwt_tenant_claims


@pytest.mark.parametrize(
    "attack",
    [
        "alg_none",
        "hs256_signed_with_the_rs256_public_key",
        "expired",
        "not_yet_valid",
        "wrong_audience",
        "no_audience",
        "wrong_issuer",
        "no_exp",
        "no_iat",
        "valid_for_longer_than_allowed",
        "another_key",
        "tampered_payload",
        "no_tenant",
        "the_reserved_anonymous_tenant",
    ],
)
def test_tokens_that_must_be_refused(signer, settings, attack):  # type: ignore[no-untyped-def]
    private, now = _pem_private(signer), int(time.time())

    def rs256(**overrides: Any) -> str:
        return jwt.encode(claims(**overrides), private, algorithm="RS256")

    token = {
        "alg_none": lambda: unsigned({"alg": "none", "typ": "JWT"}, claims()) + ".",
        # The algorithm-confusion attack: the public key (which anyone may hold) used as an HMAC secret.
        "hs256_signed_with_the_rs256_public_key": lambda: hs256_with(settings.jwt.key.encode(), claims()),
        "expired": lambda: rs256(exp=now - 3600, iat=now - 7200),
        "not_yet_valid": lambda: rs256(nbf=now + 3600),
        "wrong_audience": lambda: rs256(aud="someone-else"),
        "no_audience": lambda: rs256(aud=None),
        "wrong_issuer": lambda: rs256(iss="https://evil.example"),
        "no_exp": lambda: rs256(exp=None),
        "no_iat": lambda: rs256(iat=None),
        "valid_for_longer_than_allowed": lambda: rs256(
            iat=now, exp=now + 86400 + 60
        ),  # the default cap: a day
        "another_key": lambda: jwt.encode(
            claims(), _pem_private(rsa.generate_private_key(public_exponent=65537, key_size=2048)), "RS256"
        ),
        "tampered_payload": lambda: ".".join(
            [rs256().split(".")[0], b64(json.dumps(claims(sub="victim")).encode()), rs256().split(".")[2]]
        ),
        "no_tenant": lambda: rs256(sub=None),
        "the_reserved_anonymous_tenant": lambda: rs256(tenant="anonymous"),  # the open API's jobs
    }[attack]()
    with pytest.raises(Unauthorized) as refused:
        JwtVerifier(settings.authenticator).tenant(token)
    assert refused.value.status == 401 and refused.value.invalid
    assert refused.value.headers()["WWW-Authenticate"] == 'Bearer realm="conveyor", error="invalid_token"'


def test_hs256_when_configured_so(signer):  # type: ignore[no-untyped-def]
    secret = "s" * 32
    verifier = JwtVerifier(Settings(jwt_key=secret, jwt_algorithms=["HS256"], jwt_audience=AUD).authenticator)
    assert verifier.tenant(jwt.encode(claims(iss=None), secret, algorithm="HS256")) == "jwt:acme"
    with pytest.raises(Unauthorized):  # an RS256 token where HS256 is pinned
        verifier.tenant(jwt.encode(claims(iss=None), _pem_private(signer), algorithm="RS256"))


@pytest.mark.parametrize(
    ("update", "reason"),
    [
        ({"jwt_algorithms": ["none"]}, "never 'none'"),
        ({"jwt_algorithms": ["RS256", "HS256"]}, "mixes"),
        ({"jwt_algorithms": ["HS256"]}, "PEM key"),
        ({"jwt_algorithms": ["HS256"], "jwt_key": "short"}, "32 bytes"),
        ({"jwt_key": "not a pem"}, "not a PEM"),
        ({"jwt_audience": None}, "CONVEYOR_JWT_AUDIENCE is required"),
    ],
)
def test_unsafe_jwt_settings_stop_the_start(settings, update, reason):  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=reason):
        JwtVerifier(settings.model_copy(update=update).authenticator)


def test_the_jwt_key_can_be_a_file(signer, tmp_path):  # type: ignore[no-untyped-def]
    path = tmp_path / "jwt.pem"
    path.write_text(_pem_public(signer))
    verifier = JwtVerifier(Settings(jwt_key_file=path, jwt_audience=AUD).authenticator)
    assert verifier.tenant(jwt.encode(claims(iss=None), _pem_private(signer), "RS256")) == "jwt:acme"


def authenticate(settings: Settings, headers: dict[str, str]) -> str:
    # redis=None: with credentials in settings and a key found there, the Authenticator never asks Redis.
    auth = Authenticator(settings.authenticator, None, Keys("unit"))
    return asyncio.run(auth.authenticate(Headers(headers))).tenant


def test_api_keys_from_settings_by_either_header(signer, settings):  # type: ignore[no-untyped-def]
    key = new_api_key()
    assert key.startswith("cvk_") and len(key) == 4 + 43
    with_key = settings.model_copy(update={"api_keys": {key_digest(key): "initech"}})
    assert authenticate(with_key, {"authorization": f"Bearer {key}"}) == "initech"
    assert authenticate(with_key, {"x-api-key": key}) == "initech"
    token = jwt.encode(claims(), _pem_private(signer), algorithm="RS256")
    assert authenticate(with_key, {"authorization": f"Bearer {token}"}) == "jwt:acme"  # JWT-shaped: a JWT


def test_no_credentials_is_401_with_a_challenge(settings):  # type: ignore[no-untyped-def]
    for headers in ({}, {"authorization": "Basic dXNlcjpwYXNz"}, {"authorization": "Bearer "}):
        with pytest.raises(Unauthorized) as refused:
            authenticate(settings, headers)
        assert refused.value.headers() == {"WWW-Authenticate": 'Bearer realm="conveyor"'}
        assert refused.value.body()["error"]["code"] == "unauthorized"


def test_a_jwt_without_a_jwt_key_is_refused() -> None:
    settings = Settings(api_keys={key_digest("cvk_x"): "t"})
    with pytest.raises(Unauthorized, match="not accepted"):
        authenticate(settings, {"authorization": "Bearer a.b.c"})


def test_the_rate_limited_error_carries_its_headers() -> None:
    exc = RateLimited(
        "over", retry_after_s=0.2, rate_headers={"RateLimit-Limit": "5", "RateLimit-Remaining": "0"}
    )
    assert exc.status == 429 and exc.code == "rate_limited"
    assert exc.headers() == {"Retry-After": "1", "RateLimit-Limit": "5", "RateLimit-Remaining": "0"}


def test_the_audit_entry_has_the_prompt_only_when_enabled() -> None:
    scope = {"type": "http", "method": "POST", "path": "/v1/jobs", "client": ("10.0.0.7", 51234)}
    notes = {"tenant": "acme", "job_id": "j1", "model": "tiny", "prompt_tokens": 3, "prompt": "secret"}
    line = audit.entry(scope, notes, at=1_700_000_000.0, duration_s=0.0123, status=202, with_prompt=False)
    assert line == {
        "time": "2023-11-14T22:13:20.000+00:00",
        "tenant": "acme",
        "method": "POST",
        "path": "/v1/jobs",
        "status": 202,
        "duration_ms": 12.3,
        "client": "10.0.0.7:51234",
        "model": "tiny",
        "job_id": "j1",
        "prompt_tokens": 3,
    }
    with_prompt = audit.entry(scope, notes, at=0.0, duration_s=0.0, status=202, with_prompt=True)
    assert with_prompt["prompt"] == "secret"


def test_tls_files_reach_uvicorn_and_the_api_child(tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_text("x")
    key.write_text("y")
    settings = Settings()
    assert "ssl_certfile" not in uvicorn_options(settings, None, None)
    options = uvicorn_options(settings, cert, key)
    assert options["ssl_certfile"] == str(cert) and options["ssl_keyfile"] == str(key)
    # uvicorn builds its context (certificate, key, ciphers), the factory sets the oldest TLS version.
    server = lambda: ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)  # noqa: E731
    assert options["ssl_context_factory"](None, server).minimum_version == ssl.TLSVersion.TLSv1_3
    me = ["python", "-m", "app.cli"]
    assert api_command(me, None, None) == [*me, "api"]
    argv = api_command(me, cert, key)
    assert argv == [*me, "api", "--ssl-certfile", str(cert.resolve()), "--ssl-keyfile", str(key.resolve())]
    with pytest.raises(typer.BadParameter):
        api_command(me, cert, None)
    with pytest.raises(typer.BadParameter):
        api_command(me, cert, tmp_path / "missing.pem")
