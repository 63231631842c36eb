"""The audit the suite's shared stack ends with (tests/keyaudit.py), on a real Redis: it names a key
no builder makes and a key of a TTL family that has none, and nothing else."""

from __future__ import annotations

import uuid

import redis as redis_lib
from keyaudit import unbounded_keys

from app.core.keys import Keys


def test_the_audit_names_an_unknown_key_and_a_ttl_family_without_one(redis_url: str) -> None:
    client = redis_lib.Redis.from_url(redis_url)
    namespace = f"test-audit-{uuid.uuid4().hex[:8]}"
    keys = Keys(namespace)
    written = [keys.job("kept"), keys.job("forever"), f"{namespace}:scratch", keys.api_keys()]
    try:
        client.set(keys.job("kept"), "x", ex=60)  # a TTL family with its TTL
        client.hset(keys.job("forever"), "status", "queued")  # ... and one without
        client.set(f"{namespace}:scratch", "1", ex=60)  # a key no builder makes
        client.hset(keys.api_keys(), "digest", "{}")  # bounded otherwise (until revoked): no TTL needed
        assert sorted(unbounded_keys(client, namespace)) == [
            f"{namespace}:job:forever: family 'job' lives by a TTL "
            f"({Keys.families()['job'].ttl}) and has none",
            f"{namespace}:scratch: no builder in app/core/keys.py makes this key",
        ]
    finally:
        client.delete(*written)
