"""Per-tenant rate limits (app/core/ratelimit.py): the GCRA script on the real Redis, with a clock
passed in (exact numbers) and with Redis's own clock under three concurrent clients.

The same limits through the HTTP API, on a stack with auth configured, are in test_tenancy.py (one
stack with credentials serves both files' concerns: starting a second costs more than it shows).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import pytest
import redis.asyncio

from app.core.config import Settings, TenantLimits
from app.core.errors import InvalidRequest, MaxTokensExceeded, RateLimited
from app.core.keys import Keys
from app.core.ratelimit import RateLimiter, default_burst, policy_for

T0 = 1_700_000_000.0


@pytest.fixture()
def settings() -> Settings:
    return Settings(
        namespace=f"test-rl-{uuid.uuid4().hex[:8]}",
        rate_limit_rps=2.0,  # 4 at once: two seconds' worth
        rate_limit_tokens_per_min=600,  # 10 tokens a second, 600 at once
        embedding_bytes_per_min=2048,
        rate_limits={
            "big": TenantLimits(rps=20.0, burst=10, tokens_per_min=0, embedding_bytes_per_min=0),
            "free": TenantLimits(rps=0, tokens_per_min=0),
            "slow": TenantLimits(rps=1.25),  # its own rate, no burst: two seconds of it, rounded up
        },
    )


def run(redis_url: str, settings: Settings, body: Any) -> Any:
    async def main() -> Any:
        client = redis.asyncio.Redis.from_url(redis_url)
        try:
            return await body(RateLimiter(client, Keys(settings.namespace), settings.rate_limiter))
        finally:
            await client.aclose()

    return asyncio.run(main())


def test_policies_resolve_overrides_field_by_field(settings):  # type: ignore[no-untyped-def]
    default = policy_for(settings.rate_limiter, "anyone")
    assert default.requests is not None and default.requests.capacity == 4  # 2 x rps
    assert default.requests.interval_ms == 500.0
    assert (
        default.tokens is not None and default.tokens.capacity == 600 and default.tokens.interval_ms == 100.0
    )
    big = policy_for(settings.rate_limiter, "big")
    assert big.requests is not None and big.requests.interval_ms == 50.0 and big.tokens is None
    assert big.requests.capacity == 10  # its own burst
    slow = policy_for(settings.rate_limiter, "slow")
    assert slow.requests is not None and (slow.requests.capacity, slow.requests.interval_ms) == (3, 800.0)
    assert [default_burst(rps) for rps in (50.0, 0.001, 0.5, 1.25)] == [100, 1, 1, 3]
    free = policy_for(settings.rate_limiter, "free")
    assert free.requests is None and free.tokens is None
    assert free.embedding_bytes is not None and free.embedding_bytes.capacity == 2048  # not overridden
    assert policy_for(settings.rate_limiter, "big").embedding_bytes is None  # overridden: off


def test_embeddings_input_is_limited_in_bytes_per_tenant(redis_url, settings):  # type: ignore[no-untyped-def]
    async def body(limiter: RateLimiter) -> None:
        first = await limiter.take_embedding("free", nbytes=1500, now=T0)
        assert first is not None and first.name == "embedding_bytes" and first.remaining == 548
        with pytest.raises(RateLimited) as refused:
            await limiter.take_embedding("free", nbytes=1000, now=T0)
        assert refused.value.details["limit"] == "embedding_bytes" and refused.value.status == 429
        assert refused.value.retry_after_s == 14  # 452 bytes short at 2048 a minute: 13.2 s, rounded up
        assert "2048 bytes of embeddings input per minute" in refused.value.message
        with pytest.raises(InvalidRequest):  # more than the whole quota could never pass
            await limiter.take_embedding("free", nbytes=4096, now=T0)
        await limiter.take_embedding("big", nbytes=10**7, now=T0)  # its override turns the limit off
        # a job's submit is not charged bytes, an embeddings request not tokens
        await limiter.take("free", tokens=10**6, now=T0)

    run(redis_url, settings, body)


def test_burst_then_one_per_interval(redis, redis_url, settings):  # type: ignore[no-untyped-def]
    async def body(limiter: RateLimiter) -> None:
        quotas = [await limiter.take("acme", tokens=1, now=T0) for _ in range(4)]
        assert [q.remaining for q in quotas if q] == [3, 2, 1, 0]
        assert quotas[-1] is not None and quotas[-1].headers() == {
            "RateLimit-Limit": "4",
            "RateLimit-Remaining": "0",
            "RateLimit-Reset": "2",  # 4 requests at 0.5 s each until the bucket is full again
        }
        with pytest.raises(RateLimited) as refused:
            await limiter.take("acme", tokens=1, now=T0 + 0.1)
        assert refused.value.status == 429 and refused.value.details["limit"] == "requests"
        assert refused.value.headers()["Retry-After"] == "1"  # 0.4 s, in whole seconds
        assert refused.value.headers()["RateLimit-Remaining"] == "0"
        assert "2 requests per second (burst 4)" in refused.value.message
        await limiter.take("acme", tokens=1, now=T0 + 0.5)  # one interval later: one more
        with pytest.raises(RateLimited):
            await limiter.take("acme", tokens=1, now=T0 + 0.5)
        await limiter.take("other", tokens=1, now=T0 + 0.5)  # another tenant's bucket is its own

    run(redis_url, settings, body)
    ttl = redis.pttl(Keys(settings.namespace).rate_limit("acme"))
    assert 0 < ttl <= 2000 + 1000  # the state expires once the bucket would be full


def test_tokens_are_charged_with_the_request_all_or_nothing(redis_url, settings):  # type: ignore[no-untyped-def]
    async def body(limiter: RateLimiter) -> None:
        first = await limiter.take("acme", tokens=400, now=T0)
        assert first is not None and first.name == "tokens" and first.remaining == 200  # the tightest
        with pytest.raises(RateLimited) as refused:
            await limiter.take("acme", tokens=300, now=T0)
        assert refused.value.details["limit"] == "tokens"
        assert refused.value.retry_after_s == 10  # 100 tokens short at 10 a second
        assert refused.value.headers()["RateLimit-Limit"] == "600"
        # The refused request was not charged to the request limit either: three more fit the burst.
        for _ in range(3):
            await limiter.take("acme", tokens=0, now=T0)
        with pytest.raises(RateLimited):
            await limiter.take("acme", tokens=0, now=T0)
        # A job that was charged but not queued gets its tokens back.
        await limiter.refund("acme", tokens=400, now=T0 + 2)
        assert await limiter.take("acme", tokens=580, now=T0 + 2)

    run(redis_url, settings, body)


def test_a_job_larger_than_the_token_limit_is_422(redis_url, settings):  # type: ignore[no-untyped-def]
    async def body(limiter: RateLimiter) -> None:
        with pytest.raises(MaxTokensExceeded) as refused:
            await limiter.take("acme", tokens=601, now=T0)
        assert refused.value.status == 422 and refused.value.details["limit"] == 600
        assert "600" in refused.value.message

    run(redis_url, settings, body)


def test_a_tenant_without_limits_touches_nothing(redis, redis_url, settings):  # type: ignore[no-untyped-def]
    async def body(limiter: RateLimiter) -> None:
        for _ in range(100):
            assert await limiter.take("free", tokens=10_000, now=T0) is None

    run(redis_url, settings, body)
    assert not redis.exists(Keys(settings.namespace).rate_limit("free"))


def test_three_clients_at_ten_times_the_limit(redis_url, settings):  # type: ignore[no-untyped-def]
    """Three API processes' worth of clients (three connections, Redis's clock) hammer tenant `big`
    (20/s, burst 10) at 10x its rate for about 2 s; tenant `calm` meanwhile stays under its own limit.
    Each client sends a fixed count of requests, so a loaded machine stretches the run, never thins
    the offer: the bounds are taken against the time the run really took."""
    settings = settings.model_copy(
        update={"rate_limits": {**settings.rate_limits, "calm": TenantLimits(rps=10.0, burst=5)}}
    )
    rate, burst, seconds = 20.0, 10, 2.0
    per_client = int(rate * 10 / 3 * seconds)

    async def client(tenant: str, per_second: float, count: int) -> tuple[int, int]:
        conn = redis.asyncio.Redis.from_url(redis_url)
        limiter = RateLimiter(conn, Keys(settings.namespace), settings.rate_limiter)
        admitted = refused = 0
        try:
            for _ in range(count):
                try:
                    await limiter.take(tenant, tokens=0)
                    admitted += 1
                except RateLimited:
                    refused += 1
                await asyncio.sleep(1 / per_second)
        finally:
            await conn.aclose()
        return admitted, refused

    async def main() -> tuple[list[tuple[int, int]], float]:
        started = time.monotonic()
        hammering = [client("big", rate * 10 / 3, per_client) for _ in range(3)]
        results = await asyncio.gather(*hammering, client("calm", 5.0, int(5 * seconds)))
        return list(results), time.monotonic() - started

    results, elapsed = asyncio.run(main())
    admitted = sum(a for a, _ in results[:3])
    offered = sum(a + r for a, r in results[:3])
    assert offered == 3 * per_client and offered >= 1.5 * (rate * elapsed + burst)  # well over the limit
    assert admitted <= (rate * elapsed + burst) * 1.01
    assert admitted >= rate * seconds * 0.8  # and not refusing more than it must
    calm_admitted, calm_refused = results[3]
    assert calm_refused == 0 and calm_admitted == 10
