"""Malformed ids and text are a 4xx, never a 500 or a dropped connection.

- `Last-Event-ID` on SSE that is not an entry id Redis can read (a number past 2^64, other digits) is
  422 `invalid_request`; on the WebSocket (`?last_event_id=`), such an id, or one with a trailing
  newline, closes the socket with 4422;
- a JSON body holding a lone UTF-16 surrogate escape (`"\\ud800"`) is 400 `bad_request` on every
  route that reads one (jobs, inference, the OpenAI routes), with OpenAI's `type` on those; a proper
  pair (an emoji) and an escaped backslash before `ud800` are text like any other.

The API runs in process on the real Redis; no worker is needed (jobs stay queued).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
from fastapi.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from app.api.app import create_app
from app.api.limits import has_lone_surrogate
from tests.tinyapi import forget_namespace, tiny_settings


@pytest.fixture(scope="module")
def api(redis_url: str, tiny_model: Path) -> Iterator[TestClient]:
    settings = tiny_settings(redis_url, tiny_model, auth="none")
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        yield client
    forget_namespace(redis_url, settings.namespace)


@pytest.fixture(scope="module")
def job_id(api: TestClient) -> str:
    answer = api.post("/v1/jobs", json={"prompt": "hi", "max_tokens": 2})
    assert answer.status_code == 202
    return str(answer.json()["id"])


BAD_IDS = [
    "18446744073709551616-0",  # 2^64: past what a stream id holds
    "1-18446744073709551616",
    "123456789012345678901234567890-0",
    "1-0-0",
    "-1-0",
]


@pytest.mark.parametrize("value", BAD_IDS)
def test_a_last_event_id_redis_cannot_read_is_422_on_sse(api: TestClient, job_id: str, value: str) -> None:
    answer = api.get(f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": value})
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"]["code"] == "invalid_request"


@pytest.mark.parametrize("value", [*BAD_IDS, "1-0\n", "1-0\r\n", "\u0661-\u0660", "1-0\u2028"])
def test_a_bad_last_event_id_closes_the_websocket_with_4422(api: TestClient, job_id: str, value: str) -> None:
    url = f"/v1/jobs/{job_id}/ws?last_event_id={quote(value)}"
    with api.websocket_connect(url) as ws, pytest.raises(WebSocketDisconnect) as closed:
        ws.receive_text()
    assert closed.value.code == 4422 and closed.value.reason.startswith("invalid_request")


def test_the_largest_entry_id_is_still_an_id(api: TestClient, job_id: str) -> None:
    largest = f"{2**64 - 1}-{2**64 - 1}"  # after every event there can be: nothing more to send
    assert api.get(f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": largest}).status_code in (200, 204)


LONE = ['"a\\ud800b"', '"\\udc00"', '"\\ud800\\ud800"', '"\\ud83d x \\ude00"', '"\\ud800\\n"', '"x\\uDBFF"']
BODIES = {
    "/v1/jobs": lambda text: f'{{"prompt": {text}, "max_tokens": 2}}',
    "/v1/jobs stop": lambda text: f'{{"prompt": "hi", "max_tokens": 2, "stop": [{text}]}}',
    "/v1/inference": lambda text: f'{{"prompt": {text}, "max_tokens": 2}}',
    "/v1/completions": lambda text: f'{{"model": "tiny", "prompt": {text}, "max_tokens": 2}}',
    "/v1/chat/completions": lambda text: (
        f'{{"model": "tiny", "messages": [{{"role": "user", "content": {text}}}], "max_tokens": 2}}'
    ),
}


@pytest.mark.parametrize("text", LONE)
@pytest.mark.parametrize("route", list(BODIES))
def test_a_lone_surrogate_in_a_json_body_is_400(api: TestClient, route: str, text: str) -> None:
    answer = api.post(
        route.split()[0], content=BODIES[route](text).encode(), headers={"content-type": "application/json"}
    )
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["code"] == "bad_request" and "surrogate" in error["message"]
    if "completions" in route:
        assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("text", ['"a\\ud83d\\ude00b"', '"\\\\ud800"', '"\\\\\\\\ud800"', '"plain"'])
def test_proper_pairs_and_escaped_backslashes_are_text(api: TestClient, text: str) -> None:
    answer = api.post(
        "/v1/jobs", content=BODIES["/v1/jobs"](text).encode(), headers={"content-type": "application/json"}
    )
    assert answer.status_code == 202, answer.text


def test_the_scan_reads_escapes_as_json_does() -> None:
    assert has_lone_surrogate(b'"\\ud800"') and has_lone_surrogate(b'"\\\\\\ud800"')  # \\ then \ud800
    assert not has_lone_surrogate(b'"\\\\ud800"')  # an escaped backslash, then the letters ud800
    assert not has_lone_surrogate(b'"\\ud800\\udc00"') and not has_lone_surrogate(b"{}")
    assert has_lone_surrogate(b'"\\ud800", "\\udc00"')  # a pair must be adjacent
