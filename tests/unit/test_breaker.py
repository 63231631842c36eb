"""The circuit breaker's state machine, on the real Redis (its scripts are the state), clock injected."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio

from app.core.breaker import Action, Breaker, Policy, Snapshot, State, decide, record, recorder
from app.core.keys import Keys

T0 = 1_700_000_000.0
MODEL = "m"
POLICY = Policy(error_threshold=0.3, min_requests=100, interval_s=30.0)


@pytest.fixture()
def keys() -> Keys:
    return Keys(f"test-breaker-{uuid.uuid4().hex[:8]}")


def outcome(redis_sync: Any, keys: Keys, *, ok: int = 0, failed: int = 0, now: float) -> None:
    pipe = redis_sync.pipeline(transaction=False)
    record(pipe, keys, MODEL, succeeded=ok, failed=failed, now=now)
    pipe.execute()


def with_breaker(redis_url: str, keys: Keys, body: Callable[[Breaker], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        client = redis.asyncio.Redis.from_url(redis_url)
        try:
            return await body(Breaker(client, keys, POLICY))
        finally:
            await client.aclose()

    return asyncio.run(main())


def verdict_at(redis_url: str, keys: Keys, now: float) -> tuple[Snapshot, Action, float]:
    async def body(b: Breaker) -> tuple[Snapshot, Action, float]:
        snap = await b.snapshot(MODEL, now)
        v = decide(snap, POLICY, now)
        return snap, v.action, v.retry_after_s

    return with_breaker(redis_url, keys, body)  # type: ignore[no-any-return]


def trip(redis_url: str, keys: Keys, now: float) -> bool:
    async def body(b: Breaker) -> bool:
        return await b.trip(MODEL, await b.snapshot(MODEL, now), now)

    return with_breaker(redis_url, keys, body)  # type: ignore[no-any-return]


def claim(redis_url: str, keys: Keys, now: float) -> bool:
    return with_breaker(redis_url, keys, lambda b: b.claim_probe(MODEL, now))  # type: ignore[no-any-return]


def open_breaker(redis, redis_url, keys) -> None:  # type: ignore[no-untyped-def]
    outcome(redis, keys, ok=70, failed=30, now=T0)
    assert verdict_at(redis_url, keys, T0 + 1)[1] == Action.TRIP
    assert trip(redis_url, keys, T0 + 1)


def test_closed_until_enough_requests_fail(redis, redis_url, keys):  # type: ignore[no-untyped-def]
    outcome(redis, keys, failed=99, now=T0)
    snap, action, _ = verdict_at(redis_url, keys, T0 + 1)
    assert snap.state == State.CLOSED and action == Action.ADMIT  # 99 < min_requests
    outcome(redis, keys, ok=250, now=T0 + 2)
    assert verdict_at(redis_url, keys, T0 + 3)[1] == Action.ADMIT  # 99 of 349 failed: 0.28 < 0.3
    outcome(redis, keys, failed=10, now=T0 + 3)
    _, action, retry = verdict_at(redis_url, keys, T0 + 4)  # 109 of 359: 0.304 >= 0.3
    assert action == Action.TRIP and retry == POLICY.interval_s


def test_outcomes_older_than_the_interval_do_not_count(redis, redis_url, keys):  # type: ignore[no-untyped-def]
    outcome(redis, keys, failed=100, now=T0)
    assert verdict_at(redis_url, keys, T0 + 10)[1] == Action.TRIP
    assert verdict_at(redis_url, keys, T0 + 32)[1] == Action.ADMIT


def test_open_refuses_with_retry_after_then_admits_exactly_one_probe(redis, redis_url, keys):  # type: ignore[no-untyped-def]
    open_breaker(redis, redis_url, keys)
    snap, action, retry = verdict_at(redis_url, keys, T0 + 11)
    assert snap.state == State.OPEN and action == Action.REFUSE
    assert retry == pytest.approx(20.0)  # opened at T0+1, interval 30
    assert not trip(redis_url, keys, T0 + 12)  # already open: no second opening
    assert not claim(redis_url, keys, T0 + 20)  # too early for a probe
    assert verdict_at(redis_url, keys, T0 + 31)[1] == Action.PROBE
    claims = [claim(redis_url, keys, T0 + 31) for _ in range(5)]
    assert claims == [True, False, False, False, False]
    snap, action, _ = verdict_at(redis_url, keys, T0 + 32)
    assert snap.state == State.HALF_OPEN and action == Action.REFUSE  # the probe is out


def test_probe_success_closes_and_forgets_the_failures(redis, redis_url, keys):  # type: ignore[no-untyped-def]
    open_breaker(redis, redis_url, keys)
    assert claim(redis_url, keys, T0 + 31)
    outcome(redis, keys, ok=1, now=T0 + 33)
    snap, action, _ = verdict_at(redis_url, keys, T0 + 34)
    assert snap.state == State.CLOSED and action == Action.ADMIT
    assert snap.counted(T0 + 34, POLICY.interval_s) == (1, 0)  # only since it closed


def test_probe_failure_reopens_for_another_interval(redis, redis_url, keys):  # type: ignore[no-untyped-def]
    open_breaker(redis, redis_url, keys)
    assert claim(redis_url, keys, T0 + 31)
    outcome(redis, keys, failed=1, now=T0 + 35)
    snap, action, retry = verdict_at(redis_url, keys, T0 + 36)
    assert snap.state == State.OPEN and action == Action.REFUSE
    assert retry == pytest.approx(29.0)
    assert verdict_at(redis_url, keys, T0 + 65)[1] == Action.PROBE


def test_a_lapsed_or_released_probe_lets_another_submit_probe(redis, redis_url, keys):  # type: ignore[no-untyped-def]
    open_breaker(redis, redis_url, keys)
    assert claim(redis_url, keys, T0 + 31)
    assert not claim(redis_url, keys, T0 + 40)
    assert claim(redis_url, keys, T0 + 62)  # the first probe never reported within the interval
    with_breaker(redis_url, keys, lambda b: b.release_probe(MODEL))  # not queued after all
    assert claim(redis_url, keys, T0 + 63)


def test_outcomes_while_open_do_not_close_it(redis, redis_url, keys):  # type: ignore[no-untyped-def]
    open_breaker(redis, redis_url, keys)
    outcome(redis, keys, ok=50, now=T0 + 5)  # jobs already in the pipeline ending well
    assert verdict_at(redis_url, keys, T0 + 6)[0].state == State.OPEN


def test_a_stale_decision_does_not_reopen_a_breaker_that_closed(redis, redis_url, keys):  # type: ignore[no-untyped-def]
    open_breaker(redis, redis_url, keys)
    stale = Snapshot(state=State.CLOSED)  # read before the breaker opened (and closed again)
    assert claim(redis_url, keys, T0 + 31)
    outcome(redis, keys, ok=1, now=T0 + 32)
    assert not with_breaker(redis_url, keys, lambda b: b.trip(MODEL, stale, T0 + 33))
    assert verdict_at(redis_url, keys, T0 + 33)[0].state == State.CLOSED


def test_completion_rate_counts_from_the_first_outcome_in_the_interval(redis, redis_url, keys):  # type: ignore[no-untyped-def]
    assert verdict_at(redis_url, keys, T0)[0].completion_rate(T0, POLICY.interval_s) is None
    outcome(redis, keys, ok=5, now=T0 + 100)
    outcome(redis, keys, ok=4, failed=1, now=T0 + 104)
    snap = verdict_at(redis_url, keys, T0 + 110)[0]
    assert snap.completion_rate(T0 + 110, POLICY.interval_s) == pytest.approx(10 / 10)
    assert snap.completion_rate(T0 + 200, POLICY.interval_s) is None  # nothing within the interval


def test_decide_is_pure() -> None:
    now = T0 + 100
    assert decide(Snapshot(), POLICY, now).action == Action.ADMIT
    opened = Snapshot(state=State.OPEN, opened_at=now - 10)
    assert decide(opened, POLICY, now).action == Action.REFUSE
    assert decide(opened, POLICY, now + 20).action == Action.PROBE
    out = Snapshot(state=State.HALF_OPEN, opened_at=now - 40, probe_until=now + 5)
    assert decide(out, POLICY, now).retry_after_s == pytest.approx(5)
    assert decide(out, POLICY, now + 5).action == Action.PROBE
    failing = Snapshot(buckets={int(now) - 1: (0, 100)})
    assert decide(failing, POLICY, now).action == Action.TRIP
    assert decide(failing, Policy(min_requests=101), now).action == Action.ADMIT


def test_recorder_counts_what_an_outcomes_breaker_callback_is_given(redis, redis_url, keys):  # type: ignore[no-untyped-def]
    outcomes = recorder(redis, keys, MODEL, clock=lambda: T0)
    outcomes(3, 1)
    outcomes(0, 0)  # nothing to count: no command
    snap = verdict_at(redis_url, keys, T0 + 1)[0]
    assert snap.counted(T0 + 1, POLICY.interval_s) == (3, 1)
    assert 0 < redis.ttl(keys.outcomes(MODEL, int(T0))) <= 600
