"""A flood of requests without a key cannot roll the tenants' audit entries over: entries of requests
refused before a tenant was known go to `audit:unauthenticated`, capped apart from `audit`.

The real API app (its lifespan and audit middleware) over a real Redis, in process."""

from __future__ import annotations

import redis as redis_lib
from fastapi.testclient import TestClient

from app.api import audit
from app.api.app import create_app
from app.api.auth import key_digest, new_api_key
from app.core.keys import Keys
from tests.tinyapi import tiny_settings


def test_unauthenticated_requests_do_not_push_tenants_out_of_the_audit_stream(  # type: ignore[no-untyped-def]
    redis_url, tiny_model, monkeypatch
):
    monkeypatch.setattr(audit, "UNAUTHENTICATED_MAXLEN", 20)
    redis = redis_lib.Redis.from_url(redis_url)
    key = new_api_key()
    settings = tiny_settings(
        redis_url,
        tiny_model,
        api_keys={key_digest(key): "acme"},
        audit_maxlen=20,
    )
    keys = Keys(settings.namespace)
    try:
        with TestClient(create_app(settings)) as client:
            for _ in range(5):  # the tenant's own requests, to be kept
                assert client.get("/v1/jobs/0123456789abcdef", headers={"X-API-Key": key}).status_code == 404
            for i in range(300):  # fifteen times the cap, from anyone without a key
                headers = {"X-API-Key": f"guess-{i}"} if i % 2 else {}
                assert client.get("/v1/jobs/0123456789abcdef", headers=headers).status_code == 401

        tenants = [fields[b"tenant"] for _, fields in redis.xrange(keys.audit())]
        assert tenants == [b"acme"] * 5  # every one of the tenant's entries survives the flood
        refused = redis.xrange(keys.audit_unauthenticated())
        assert refused and all(fields[b"status"] == b"401" for _, fields in refused)
        # capped (MAXLEN ~ trims whole stream nodes, so a little over the cap, far under the flood)
        assert len(refused) < 300 and redis.xlen(keys.audit_unauthenticated()) < 300
    finally:
        redis.delete(keys.audit(), keys.audit_unauthenticated())
