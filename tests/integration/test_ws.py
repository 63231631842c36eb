"""/v1/jobs/{id}/ws over the network: the same events as the job's server-sent events, resumable."""

from __future__ import annotations

import json
from typing import Any

import pytest
from clients import events, submit
from websockets.exceptions import ConnectionClosedError
from websockets.sync.client import connect


def ws_url(stack, job_id: str, last_event_id: str | None = None) -> str:  # type: ignore[no-untyped-def]
    url = f"{stack.url.replace('http://', 'ws://', 1)}/v1/jobs/{job_id}/ws"
    return f"{url}?last_event_id={last_event_id}" if last_event_id is not None else url


def ws_events(url: str, *, max_tokens: int | None = None) -> tuple[list[dict[str, Any]], int | None]:
    """The messages until the server closes (or `max_tokens` token events, then hang up); the close code."""
    out: list[dict[str, Any]] = []
    with connect(url, open_timeout=30) as ws:
        for message in ws:  # ends when the server closes normally
            out.append(json.loads(message))
            if max_tokens is not None and sum(m["event"] == "token" for m in out) >= max_tokens:
                return out, None
        return out, ws.close_code


def as_tuples(messages: list[dict[str, Any]]) -> list[tuple[str, str, Any]]:
    return [(m["id"], m["event"], m["data"]) for m in messages]


def test_the_websocket_carries_exactly_the_sse_events(stack):  # type: ignore[no-untyped-def]
    with stack.client() as client:
        job = submit(client, prompt="Follow me", max_tokens=40, temperature=0, ignore_eos=True)
        live, code = ws_events(ws_url(stack, job["id"]))  # connected while the job runs: the live tail
        sse = events(client, job["urls"]["events"])
    assert code == 1000, "a normal close after the final event"
    assert set(live[0]) == {"id", "event", "data"}
    assert as_tuples(live) == [(e.id, e.event, e.data) for e in sse]
    assert [m["event"] for m in live] == ["token"] * 40 + ["done"]
    assert live[-1]["data"]["status"] == "succeeded"
    assert "".join(m["data"]["text"] for m in live[:-1]) == live[-1]["data"]["text"]


def test_resume_with_last_event_id_gives_exactly_the_rest(stack):  # type: ignore[no-untyped-def]
    with stack.client() as client:
        job = submit(client, prompt="Resume me", max_tokens=30, temperature=0, ignore_eos=True)
    first, _ = ws_events(ws_url(stack, job["id"]), max_tokens=5)  # and hang up
    rest, code = ws_events(ws_url(stack, job["id"], first[-1]["id"]))
    whole, _ = ws_events(ws_url(stack, job["id"]))
    assert [m["data"]["index"] for m in first] == [0, 1, 2, 3, 4]
    assert code == 1000 and rest[-1]["event"] == "done"
    assert as_tuples(first + rest) == as_tuples(whole), "no gap, no duplicate"
    after_the_end, code = ws_events(ws_url(stack, job["id"], rest[-1]["id"]))
    assert after_the_end == [] and code == 1000, (
        "resuming after the final event: nothing more, a normal close"
    )


@pytest.mark.parametrize(
    ("job_id", "last_event_id", "code", "reason"),
    [("no-such-job", None, 4404, "job_not_found"), ("no-such-job", "garbage", 4422, "invalid_request")],
)
def test_refusals_are_close_codes(stack, job_id, last_event_id, code, reason):  # type: ignore[no-untyped-def]
    with (
        connect(ws_url(stack, job_id, last_event_id), open_timeout=30) as ws,
        pytest.raises(ConnectionClosedError),
    ):
        ws.recv(timeout=30)
    assert ws.close_code == code
    assert ws.close_reason.startswith(reason)


def test_a_follower_that_leaves_does_not_cancel_the_job(stack):  # type: ignore[no-untyped-def]
    with stack.client() as client:
        job = submit(client, prompt="Keep going", max_tokens=60, temperature=0, ignore_eos=True)
        seen, _ = ws_events(ws_url(stack, job["id"]), max_tokens=2)
        assert len(seen) == 2
        final = events(client, job["urls"]["events"])[-1]
    assert final.event == "done" and final.data["status"] == "succeeded"
