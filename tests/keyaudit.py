"""What a stack leaves in Redis, held against the lifetimes `app/core/keys.py` declares: every key
under the namespace is one a builder makes, and every key of a family declared with a TTL has one."""

from __future__ import annotations

from typing import Any

from app.core.keys import Keys


def unbounded_keys(redis: Any, namespace: str) -> list[str]:
    """The keys that break their declaration, each with why; empty when every key keeps it."""
    keys = Keys(namespace)
    wrong = []
    for raw in redis.scan_iter(match=f"{namespace}:*", count=1000):
        key = raw.decode() if isinstance(raw, bytes) else raw
        found = keys.lifetime_of(key)
        if found is None:
            wrong.append(f"{key}: no builder in app/core/keys.py makes this key")
            continue
        family, lifetime = found
        if lifetime.ttl and redis.ttl(key) == -1:  # -2: gone since the scan, which is fine
            wrong.append(f"{key}: family {family!r} lives by a TTL ({lifetime.ttl}) and has none")
    return wrong
