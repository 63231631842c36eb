"""The API answers only its own names (CONVEYOR_ALLOWED_HOSTS: a page that points its own name at the
API, DNS rebinding, gets 400 `host_not_allowed`), and a job's WebSocket only the API's own pages, the
allowed origins (CONVEYOR_ALLOWED_ORIGINS) and clients that send no Origin (close code 4403)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from app.api.app import create_app
from app.core.config import Settings
from tests.tinyapi import forget_namespace, namespace_keys, tiny_settings

DEFAULT_HOSTS = Settings.model_fields["allowed_hosts"].default_factory()  # type: ignore[misc]


@pytest.fixture()
def api(redis_url, tiny_model) -> Iterator[TestClient]:  # type: ignore[no-untyped-def]
    settings = tiny_settings(
        redis_url,
        tiny_model,
        auth="none",
        allowed_hosts=DEFAULT_HOSTS,  # what `make run` serves with
        allowed_origins=["https://app.example.com"],
    )
    try:
        with TestClient(create_app(settings), base_url="http://127.0.0.1:8000") as client:
            yield client
    finally:
        forget_namespace(redis_url, settings.namespace)


@pytest.mark.parametrize("host", ["127.0.0.1:8000", "localhost:8000", "LOCALHOST", "[::1]:8000"])
def test_the_api_answers_its_own_names(api: TestClient, host: str) -> None:
    answer = api.get("/v1/jobs/0123456789abcdef0123456789abcdef", headers={"host": host})
    assert answer.status_code == 404, answer.text  # past the Host check: the route answered


@pytest.mark.parametrize(
    "host", ["attacker.example", "attacker.example:8000", "127.0.0.1.attacker.example", ""]
)
def test_another_host_is_refused_with_400_and_nothing_is_queued(api: TestClient, redis, host: str) -> None:  # type: ignore[no-untyped-def]
    answer = api.post("/v1/jobs", json={"prompt": "hi", "max_tokens": 2}, headers={"host": host})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["code"] == "host_not_allowed" and "CONVEYOR_ALLOWED_HOSTS" in error["message"]
    assert not namespace_keys(redis, f"{api.app.state.settings.namespace}:job")  # type: ignore[attr-defined]
    # Probes and scrapers address a pod by its IP: health and metrics answer whatever the Host.
    assert api.get("/healthz", headers={"host": host}).status_code == 200
    assert api.get("/metrics", headers={"host": host}).status_code == 200


def close_code(api: TestClient, headers: dict[str, str]) -> tuple[int, str]:
    headers = {"host": "127.0.0.1:8000", **headers}  # as a browser on the API's own page sends it
    with (
        pytest.raises(WebSocketDisconnect) as closed,
        api.websocket_connect("/v1/jobs/0123456789abcdef0123456789abcdef/ws", headers=headers) as ws,
    ):
        ws.receive_json()
    return closed.value.code, closed.value.reason


@pytest.mark.parametrize(
    "origin", [None, "http://127.0.0.1:8000", "https://app.example.com", "https://APP.example.com/"]
)
def test_a_websocket_from_no_browser_the_apis_own_page_or_an_allowed_origin_is_served(
    api: TestClient, origin: str | None
) -> None:
    headers = {} if origin is None else {"origin": origin}
    assert close_code(api, headers)[0] == 4404  # past the Origin check: no such job


@pytest.mark.parametrize(
    "origin", ["https://attacker.example", "http://127.0.0.1:3000", "http://localhost:8000", "null"]
)
def test_a_websocket_from_another_origin_is_closed_4403(api: TestClient, origin: str) -> None:
    code, reason = close_code(api, {"origin": origin})
    assert code == 4403 and reason.startswith("origin_not_allowed:"), (code, reason)


def test_a_websocket_to_another_host_is_closed_4400(api: TestClient) -> None:
    code, reason = close_code(api, {"host": "attacker.example"})
    assert code == 4400 and reason.startswith("host_not_allowed:"), (code, reason)
