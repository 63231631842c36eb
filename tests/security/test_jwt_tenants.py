"""JWT bearer tokens name tenants of their own and live briefly.

- a token's subject is a tenant in its own namespace (`jwt:<sub>`): a token with `sub: alice` cannot
  read, stream or cancel the jobs of API-key tenant `alice`;
- `aud` is required (an API with a JWT key and no `CONVEYOR_JWT_AUDIENCE` does not start), and so is
  `iat`; a token valid for longer than `CONVEYOR_JWT_MAX_LIFETIME_S` is 401;
- the published example HS256 secret is refused in `CONVEYOR_JWT_KEY_FILE` as in `CONVEYOR_JWT_KEY`,
  and a key file's trailing newline is not part of the key.

The API runs in process on the real Redis; no worker is needed (jobs stay queued).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jwt
import pytest
from fastapi.testclient import TestClient

from app.api.app import create_app
from app.api.auth import JwtVerifier, key_digest, new_api_key
from app.core.config import Settings
from app.core.known_secrets import KnownSecret, known_secrets_in_use
from tests.tinyapi import forget_namespace, tiny_settings

SECRET = os.urandom(32).hex()
AUD = "conveyor-tests"
KEY = new_api_key()


def token(secret: str = SECRET, **overrides: Any) -> str:
    now = int(time.time())
    claims: dict[str, Any] = {"sub": "alice", "aud": AUD, "iat": now, "exp": now + 300} | overrides
    return jwt.encode({k: v for k, v in claims.items() if v is not None}, secret, algorithm="HS256")


@pytest.fixture(scope="module")
def api(redis_url: str, tiny_model: Path) -> Iterator[TestClient]:
    settings = tiny_settings(
        redis_url,
        tiny_model,
        api_keys={key_digest(KEY): "alice"},
        jwt_key=SECRET,
        jwt_algorithms=["HS256"],
        jwt_audience=AUD,
        jwt_max_lifetime_s=3600,
    )
    with TestClient(create_app(settings)) as client:
        yield client
    forget_namespace(redis_url, settings.namespace)


def test_a_token_naming_an_api_key_tenant_cannot_reach_its_jobs(api: TestClient) -> None:
    as_key = {"Authorization": f"Bearer {KEY}"}
    as_token = {"Authorization": f"Bearer {token()}"}
    job = api.post("/v1/jobs", json={"prompt": "hi", "max_tokens": 2}, headers=as_key)
    assert job.status_code == 202, job.text
    job_id = job.json()["id"]
    assert api.get(f"/v1/jobs/{job_id}", headers=as_key).status_code == 200
    for answer in (
        api.get(f"/v1/jobs/{job_id}", headers=as_token),
        api.post(f"/v1/jobs/{job_id}/cancel", headers=as_token),
    ):
        assert answer.status_code == 404 and answer.json()["error"]["code"] == "job_not_found"
    # the token's own jobs are its own, under its namespaced tenant
    mine = api.post("/v1/jobs", json={"prompt": "hi", "max_tokens": 2}, headers=as_token)
    assert mine.status_code == 202
    assert api.get(f"/v1/jobs/{mine.json()['id']}", headers=as_token).status_code == 200
    assert api.get(f"/v1/jobs/{mine.json()['id']}", headers=as_key).status_code == 404


@pytest.mark.parametrize(
    "claims",
    [
        {"aud": None},  # no audience
        {"iat": None},  # no issue time: its lifetime unknown
        {"iat": int(time.time()), "exp": int(time.time()) + 3600 + 120},  # valid longer than 3600 s
    ],
)
def test_tokens_without_an_audience_or_too_long_lived_are_401(
    api: TestClient, claims: dict[str, Any]
) -> None:
    answer = api.get("/v1/models", headers={"Authorization": f"Bearer {token(**claims)}"})
    assert answer.status_code == 401, answer.text


def test_an_api_with_a_jwt_key_and_no_audience_does_not_start(redis_url: str, tiny_model: Path) -> None:
    settings = tiny_settings(redis_url, tiny_model, jwt_key=SECRET, jwt_algorithms=["HS256"])
    with pytest.raises(ValueError, match="CONVEYOR_JWT_AUDIENCE"), TestClient(create_app(settings)):
        pass


@pytest.mark.parametrize("ending", ["", "\n", "\r\n", "  \n"])
def test_the_published_secret_is_refused_in_a_key_file(tmp_path: Path, ending: str) -> None:
    path = tmp_path / "jwt.key"
    path.write_text("example-jwt-secret-change-me-at-least-32-bytes" + ending)
    settings = Settings(jwt_key_file=path, jwt_algorithms=["HS256"], jwt_audience=AUD)
    assert any("CONVEYOR_JWT_KEY_FILE" in found for found in known_secrets_in_use(settings))
    with pytest.raises(KnownSecret, match="CONVEYOR_JWT_KEY_FILE"):
        create_app(settings)


def test_a_key_files_trailing_newline_is_not_part_of_the_key(tmp_path: Path) -> None:
    path = tmp_path / "jwt.key"
    path.write_text(SECRET + "\n")  # as `echo "$SECRET" > jwt.key` writes it
    verifier = JwtVerifier(
        Settings(jwt_key_file=path, jwt_algorithms=["HS256"], jwt_audience=AUD).authenticator
    )
    assert verifier.tenant(token()) == "jwt:alice"
