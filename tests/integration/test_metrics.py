"""Prometheus metrics: after one job, every process of a 2-stage stack exposes live values."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest
from clients import submit, wait
from conftest import Stack
from prometheus_client.parser import text_string_to_metric_families

# every process's own metrics port
pytestmark = pytest.mark.e2e

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> Samples:
    response = httpx.get(url, timeout=10)
    assert response.status_code == 200, url
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum over the samples of `name` whose labels include `labels` (0 when there is none)."""
    wanted = set(labels.items())
    return sum(v for (n, have), v in samples.items() if n == name and wanted <= have)


def ports(log: Path) -> dict[str, int]:
    """Each child's metrics port, from the line `conveyor up` prints."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = next((x for x in log.read_text().splitlines() if "[conveyor] metrics " in x), None)
        if line:
            return {name: int(port) for name, port in re.findall(r"(\w[\w.]*) :(\d+)", line)}
        time.sleep(0.2)
    raise AssertionError("conveyor up printed no metrics ports")


@pytest.fixture()
def stack(two_stage_stack: Stack) -> Stack:
    """The whole stack of two stages, two embeddings workers and a metrics port each (conftest.py),
    shared with test_embeddings.py: what these tests count is the tiny model's."""
    return two_stage_stack


def test_after_one_job_every_process_exposes_live_metrics(stack: Stack) -> None:
    started = time.time()
    with stack.client() as client:
        job = submit(client, prompt="count the metrics", max_tokens=6, ignore_eos=True, priority="high")
        done = wait(client, job["id"])
        assert done["status"] == "succeeded"
        refused = client.post("/v1/jobs", json={"prompt": "x", "priority": "high", "timeout_s": 0.001})
    on = ports(stack.log)
    assert set(on) == {"batcher", "webhooks", "callbacks", "stage0", "stage1", "embed0", "embed1"}

    api = scrape(f"{stack.url}/metrics")
    assert value(api, "conveyor_http_requests_total", route="/v1/jobs", method="POST", status="202") >= 1
    assert (
        value(api, "conveyor_http_requests_total", route="/v1/jobs/{job_id}", method="GET", status="200") >= 1
    )
    assert value(api, "conveyor_http_request_duration_seconds_count", route="/v1/jobs", method="POST") >= 1
    assert value(api, "conveyor_workers_live", model="tiny", stage="0") == 1
    assert value(api, "conveyor_workers_live", model="tiny", stage="1") == 1
    assert (("conveyor_breaker_state", frozenset({("model", "tiny")}))) in api
    assert value(api, "conveyor_breaker_state", model="tiny") == 0  # closed
    assert ("conveyor_intake_depth", frozenset({("model", "all"), ("priority", "high")})) in api
    if refused.status_code in (429, 503):  # a 1 ms timeout may still be met on an idle stack
        reason = refused.json()["error"]["code"]
        assert value(api, "conveyor_admission_refused_total", reason=reason) >= 1

    batcher = scrape(f"http://127.0.0.1:{on['batcher']}/metrics")
    assert value(batcher, "conveyor_intake_wait_seconds_count", model="tiny", priority="high") >= 1
    assert value(batcher, "conveyor_batch_size_count", model="tiny") >= 1
    assert value(batcher, "conveyor_batch_size_sum", model="tiny") >= 1
    assert value(batcher, "conveyor_batch_padding_ratio_count", model="tiny") >= 1

    first = scrape(f"http://127.0.0.1:{on['stage0']}/metrics")
    last = scrape(f"http://127.0.0.1:{on['stage1']}/metrics")
    for stage, samples in (("0", first), ("1", last)):
        # a prefill and 5 decode steps went through each partition
        assert (
            value(samples, "conveyor_partition_latency_seconds_count", model="tiny", partition_id=stage) >= 6
        )
        assert value(samples, "conveyor_partition_latency_seconds_sum", model="tiny", partition_id=stage) > 0
        beat = value(samples, "conveyor_worker_heartbeat_timestamp_seconds", model="tiny", stage=stage)
        assert beat >= started - 30
        assert value(samples, "conveyor_device_memory_used_bytes", device="cpu") > 10 * 2**20
    assert value(last, "conveyor_time_to_first_token_seconds_count", model="tiny", priority="high") == 1
    assert value(last, "conveyor_inter_token_latency_seconds_count", model="tiny") == 5
    assert value(last, "conveyor_job_latency_seconds_count", model="tiny", priority="high") == 1
    assert value(last, "conveyor_tokens_generated_total", model="tiny") == 6
    assert value(last, "conveyor_jobs_total", model="tiny", status="succeeded", reason="length") == 1
    ttft = value(last, "conveyor_time_to_first_token_seconds_sum", model="tiny")
    e2e = value(last, "conveyor_job_latency_seconds_sum", model="tiny")
    assert 0 < ttft <= e2e <= time.time() - started + 1

    for name in ("webhooks", "callbacks"):
        samples = scrape(f"http://127.0.0.1:{on[name]}/metrics")
        assert value(samples, "process_resident_memory_bytes") > 0


def test_a_cancelled_job_is_counted_by_the_api(stack: Stack) -> None:
    with stack.client() as client:
        job = submit(client, prompt="cancel me", max_tokens=500, ignore_eos=True)
        assert client.post(f"/v1/jobs/{job['id']}/cancel").status_code == 200
        assert wait(client, job["id"])["status"] == "cancelled"
    api = scrape(f"{stack.url}/metrics")
    assert value(api, "conveyor_jobs_total", model="tiny", status="cancelled", reason="cancelled") >= 1
