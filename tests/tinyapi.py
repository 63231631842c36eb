"""Settings for an API over the tiny model in a namespace of its own, and forgetting that namespace.

Most security and API tests build the app in process (`create_app(settings)`) against the real
Redis; this is the one place that says what such an app serves (the tiny model, no embeddings
workers), so each test lists only the settings it is about.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import redis as redis_lib

from app.core.config import Settings

# The names the API answers by default, and the Host a TestClient sends.
TEST_HOSTS = ["localhost", "127.0.0.1", "::1", "testserver"]


def tiny_settings(redis_url: str, tiny_model: Path, **overrides: object) -> Settings:
    """The tiny model as the only and default model, no embeddings workers, a fresh namespace
    (unless `namespace` is among the overrides), and the test's own settings on top."""
    fields: dict[str, object] = {
        "redis_url": redis_url,
        "namespace": f"test-{uuid.uuid4().hex[:8]}",
        "models": {"tiny": tiny_model},
        "default_model": "tiny",
        "embedding_stages": 0,
        "allowed_hosts": TEST_HOSTS,
    }
    return Settings(**(fields | overrides))  # type: ignore[arg-type]


def namespace_keys(client: redis_lib.Redis, namespace: str) -> list[bytes]:
    """Every key of `namespace`, 1,000 a SCAN call: at SCAN's default of 10, the tests' shared Redis
    (thousands of keys) took ~1,600 round trips a look."""
    return list(client.scan_iter(match=f"{namespace}:*", count=1000))


def forget_keys(client: redis_lib.Redis, namespace: str) -> None:
    """Delete every key of `namespace` (what a test wrote)."""
    if found := namespace_keys(client, namespace):
        client.delete(*found)


def forget_namespace(redis_url: str, namespace: str) -> None:
    forget_keys(redis_lib.Redis.from_url(redis_url), namespace)
