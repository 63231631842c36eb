"""Authentication fails closed: an API with no credential anywhere refuses every request (401, with a
body that says why) instead of serving it as `anonymous`; revoking the last key closes the API rather
than opening it; anonymous service is an explicit setting (CONVEYOR_AUTH=none), and counted.

The real API app (its lifespan included) over a real Redis, in process."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis as redis_lib
from fastapi.testclient import TestClient
from prometheus_client import REGISTRY

from app.api.app import create_app
from app.api.auth import Authenticator, key_digest, new_api_key
from app.core.config import Settings
from app.core.keys import Keys
from tests.tinyapi import tiny_settings

PROTECTED = "/v1/jobs/0123456789abcdef"  # any protected route; 404 once past authentication


@contextmanager
def api(redis_url: str, tiny_model: Path, **settings: object) -> Iterator[tuple[TestClient, Keys]]:
    config = tiny_settings(redis_url, tiny_model, **settings)
    keys = Keys(config.namespace)
    try:
        with TestClient(create_app(config)) as client:
            yield client, keys
    finally:
        redis_lib.Redis.from_url(redis_url).delete(keys.api_keys())


def store_key(redis: redis_lib.Redis, keys: Keys, tenant: str) -> str:
    """A key as `conveyor keys create` stores one."""
    key = new_api_key()
    redis.hset(keys.api_keys(), key_digest(key), f'{{"tenant": "{tenant}"}}')
    return key


def test_no_credential_anywhere_is_401_not_anonymous(redis_url, redis, tiny_model):  # type: ignore[no-untyped-def]
    with api(redis_url, tiny_model) as (client, keys):
        assert redis.hlen(keys.api_keys()) == 0
        for headers in ({}, {"Authorization": "Bearer sk-placeholder"}, {"X-API-Key": "whatever"}):
            answer = client.get(PROTECTED, headers=headers)
            assert answer.status_code == 401, (headers, answer.text)
            assert answer.json()["error"]["code"] == "unauthorized"
        refused = client.post("/v1/jobs", json={"prompt": "hi", "max_tokens": 1})
        assert refused.status_code == 401
        error = refused.json()["error"]
        assert error["details"]["reason"] == "no_credentials_configured"
        assert "conveyor keys create" in error["message"] and "CONVEYOR_AUTH=none" in error["message"]
        assert client.get("/healthz").status_code == 200  # health stays open


def test_revoking_the_last_key_closes_the_api(redis_url, redis, tiny_model):  # type: ignore[no-untyped-def]
    with api(redis_url, tiny_model) as (client, keys):
        key = store_key(redis, keys, "acme")
        assert client.get(PROTECTED, headers={"X-API-Key": key}).status_code == 404  # let in
        assert client.get(PROTECTED).status_code == 401
        redis.hdel(keys.api_keys(), key_digest(key))  # `conveyor keys revoke`: the last key goes
        assert client.get(PROTECTED, headers={"X-API-Key": key}).status_code == 401
        assert client.get(PROTECTED, headers={"Authorization": f"Bearer {key}"}).status_code == 401
        assert client.get(PROTECTED).status_code == 401


def test_keys_in_settings_are_the_whole_list(redis_url, redis, tiny_model, caplog):  # type: ignore[no-untyped-def]
    configured, namespace = new_api_key(), f"test-{uuid.uuid4().hex[:8]}"
    stored = store_key(redis, Keys(namespace), "acme")  # before the start: the API says it is not checked
    settings = {"namespace": namespace, "api_keys": {key_digest(configured): "ops"}}
    caplog.set_level(logging.WARNING, logger="app.api.app")
    with api(redis_url, tiny_model, **settings) as (client, _):
        assert client.get(PROTECTED, headers={"X-API-Key": configured}).status_code == 404
        assert client.get(PROTECTED, headers={"X-API-Key": stored}).status_code == 401
    assert "the 1 API keys stored in Redis are not checked" in caplog.text


def anonymous_served() -> float:
    return REGISTRY.get_sample_value("conveyor_anonymous_requests_total") or 0.0


def test_anonymous_service_is_explicit_and_counted(redis_url, tiny_model):  # type: ignore[no-untyped-def]
    with api(redis_url, tiny_model, auth="none") as (client, _):
        before = anonymous_served()
        assert client.get(PROTECTED).status_code == 404  # served, as tenant anonymous
        assert client.get(PROTECTED, headers={"Authorization": "Bearer sk-placeholder"}).status_code == 404
        assert anonymous_served() == before + 2
        assert "conveyor_anonymous_requests_total" in client.get("/metrics").text


def test_anonymous_mode_with_credentials_configured_does_not_start() -> None:
    settings = Settings(auth="none", api_keys={key_digest(new_api_key()): "ops"})
    with pytest.raises(ValueError, match="CONVEYOR_AUTH=none"):
        Authenticator(settings.authenticator, None, Keys("unit"))


def test_keys_in_settings_need_no_redis_to_count_as_credentials() -> None:
    key = new_api_key()
    auth = Authenticator(Settings(api_keys={key_digest(key): "ops"}).authenticator, None, Keys("unit"))
    assert asyncio.run(auth.has_credentials())
