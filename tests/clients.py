"""Small HTTP helpers the tests use as a client would: submit, poll, read server-sent events."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

TERMINAL = {"succeeded", "failed", "cancelled", "expired"}


@dataclass
class SseEvent:
    id: str | None
    event: str
    data: Any


def submit(client: httpx.Client, **body: Any) -> dict[str, Any]:
    answer = client.post("/v1/jobs", json=body)
    assert answer.status_code == 202, answer.text
    return answer.json()  # type: ignore[no-any-return]


def wait(client: httpx.Client, job_id: str, timeout_s: float = 120.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in TERMINAL:
            return job  # type: ignore[no-any-return]
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} did not finish in {timeout_s} s")


def events(
    client: httpx.Client,
    url: str,
    *,
    last_event_id: str | None = None,
    max_tokens: int | None = None,
    method: str = "GET",
    json_body: Any = None,
) -> list[SseEvent]:
    """Read a job's event stream until done/error, or until `max_tokens` token events, then disconnect."""
    headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
    out: list[SseEvent] = []
    with client.stream(method, url, headers=headers, json=json_body) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        fields: dict[str, str] = {}
        data: list[str] = []
        for line in sse_lines(response):
            if line.startswith(":"):
                continue
            if line:
                name, _, value = line.partition(":")
                value = value.removeprefix(" ")
                if name == "data":
                    data.append(value)
                else:
                    fields[name] = value
                continue
            if not data:
                continue
            event = SseEvent(fields.get("id"), fields.get("event", "message"), json.loads("\n".join(data)))
            out.append(event)
            fields, data = {}, []
            if event.event in ("done", "error", "cancelled", "expired"):
                break
            if max_tokens is not None and sum(e.event == "token" for e in out) >= max_tokens:
                break
    return out


def sse_lines(response: httpx.Response) -> Any:
    """Lines as the SSE spec splits them (CR LF, LF or CR only): `iter_lines` would also split on
    U+2028, U+0085 and the like, which a model may well generate inside a JSON string."""
    buffer = ""
    for chunk in response.iter_text():
        buffer += chunk
        while True:
            cut = min((i for i in (buffer.find("\r"), buffer.find("\n")) if i >= 0), default=-1)
            if cut < 0 or (buffer[cut] == "\r" and cut + 1 == len(buffer)):
                break  # a CR at the end may be the first half of CR LF
            step = 2 if buffer.startswith("\r\n", cut) else 1
            yield buffer[:cut]
            buffer = buffer[cut + step :]
    if buffer:
        yield buffer


def tokens(stream: list[SseEvent]) -> list[SseEvent]:
    return [e for e in stream if e.event == "token"]
