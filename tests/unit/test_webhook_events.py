"""Webhook rules that need no services: token batching, event ids and bodies, backoff, Retry-After."""

from __future__ import annotations

import email.utils
import json

import pytest

from app.webhooks import events as ev
from app.webhooks.delivery import backoff_s, retry_after_s


def test_tokens_are_batched_per_interval_and_a_batch_remembers_where_to_resume() -> None:
    batches = ev.TokenBatches(0.5)
    batches.add("a", "100-0", {"index": 0, "text": "He"}, now=10.0, cursor=None)
    batches.add("a", "101-0", {"index": 1, "text": "llo"}, now=10.3, cursor="100-0")
    batches.add("b", "102-0", {"index": 0, "text": "x"}, now=10.2, cursor="90-0")
    assert batches.due(10.4) == []
    assert batches.next_due_in(10.4) == pytest.approx(0.1)
    assert batches.due(10.5) == ["a"]
    batch = batches.take("a")
    assert batch is not None and batch.resume_after is None and batch.first_entry == "100-0"
    out = ev.token_event("a", batch)
    assert out.webhook_id == "msg_a_token_100-0"
    body = json.loads(out.body)
    assert body["type"] == "job.token" and body["data"]["text"] == "Hello"
    assert [t["index"] for t in body["data"]["tokens"]] == [0, 1]
    assert batches.holding("b") is not None and batches.holding("b").resume_after == "90-0"  # type: ignore[union-attr]


def test_event_ids_are_stable_and_bodies_are_the_standard_envelope() -> None:
    assert ev.webhook_id("j1", "completed") == "msg_j1_completed"
    body = json.loads(ev.body("completed", ev.entry_time("1700000000123-0"), {"id": "j1"}))
    assert body == {
        "type": "job.completed",
        "timestamp": "2023-11-14T22:13:20.123+00:00",
        "data": {"id": "j1"},
    }
    assert ev.kind_of_final("done") == "completed"
    assert {ev.kind_of_final(e) for e in ("error", "expired", "cancelled")} == {"failed"}
    assert ev.parse_events(None) == frozenset(ev.DEFAULT_EVENTS)
    assert ev.parse_events('["token"]') == {"token"}


def test_backoff_doubles_with_jitter_in_the_upper_half_and_never_shrinks() -> None:
    low = [backoff_s(n, base_s=1.0, max_s=60.0, rand=lambda: 0.0) for n in range(1, 9)]
    high = [backoff_s(n, base_s=1.0, max_s=60.0, rand=lambda: 1.0) for n in range(1, 9)]
    assert low == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0]
    assert high == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]
    # attempt n's highest delay is attempt n+1's lowest: however the dice fall, delays do not shrink
    assert all(h <= lo for h, lo in zip(high[:-1], low[1:], strict=True))


def test_retry_after_in_seconds_or_as_a_date() -> None:
    assert retry_after_s("120", now=0.0) == 120.0
    assert retry_after_s(email.utils.formatdate(1000.0 + 30, usegmt=True), now=1000.0) == pytest.approx(30.0)
    assert retry_after_s(email.utils.formatdate(10.0, usegmt=True), now=1000.0) == 0.0  # in the past
    assert retry_after_s(None, now=0.0) is None
    assert retry_after_s("soon", now=0.0) is None
