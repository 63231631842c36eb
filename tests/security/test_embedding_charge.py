"""An embeddings request is charged the work it makes, not its bytes: a batch pads every text to the
longest, so 63 one-byte texts beside a 300-byte one cost as much as 64 texts of 300 bytes, and were
charged 363 bytes. Now the tenant's `embedding_bytes_per_min` is charged the padded positions at two
bytes each (`intake.padded_bytes`), or the bytes if more.

The real API app in process over a real Redis, embeddings on, no worker (a request that passes the
limit waits the job service's `sync_timeout_s`, shortened here, and is answered 504: the charge is
what the test looks at).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.api.app import create_app
from app.batching.intake import padded_positions
from tests.tinyapi import forget_namespace, tiny_settings

TEXTS = ["x" * 300] + ["a"] * 63  # 363 bytes; padded: 64 rows of the longest
PADDED = 2 * padded_positions(TEXTS)


@pytest.fixture()
def api(redis_url: str, tiny_model: Path, request: pytest.FixtureRequest) -> Iterator[TestClient]:
    settings = tiny_settings(
        redis_url,
        tiny_model,
        auth="none",
        embedding_stages=2,
        heartbeat_ttl_s=5e8,  # no workers: the stage gate would refuse after its grace (2 x this)
        rate_limits={"anonymous": {"embedding_bytes_per_min": request.param}},
    )
    try:
        with TestClient(create_app(settings)) as client:
            client.app.state.jobs.sync_timeout_s = 0.2  # type: ignore[attr-defined]
            yield client
    finally:
        forget_namespace(redis_url, settings.namespace)


def embed(client: TestClient) -> tuple[int, dict[str, object]]:
    answer = client.post("/v1/embeddings", json={"input": TEXTS})
    return answer.status_code, answer.json()["error"]


@pytest.mark.parametrize("api", [PADDED + 1000], indirect=True)
def test_a_padded_request_is_charged_its_padded_positions(api):  # type: ignore[no-untyped-def]
    assert sum(len(t) for t in TEXTS) == 363 and PADDED == 2 * 64 * 152
    status, _ = embed(api)
    assert status == 504  # charged and queued: nobody runs it
    status, error = embed(api)  # the minute's allowance is spent on one request's padding
    assert status == 429 and error["code"] == "rate_limited", error


@pytest.mark.parametrize("api", [PADDED // 2], indirect=True)
def test_a_request_padded_past_the_whole_limit_is_422(api):  # type: ignore[no-untyped-def]
    status, error = embed(api)
    assert status == 422 and error["code"] == "invalid_request", error
    assert error["details"] == {"limit": PADDED // 2}
    assert str(PADDED) in str(error["message"])
