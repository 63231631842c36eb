"""Faults under load: a stage worker or the batcher killed mid-generation loses no job and no token."""

from __future__ import annotations

import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
from clients import events, submit, tokens, wait
from conftest import start_stack

# SIGKILL of stage workers
pytestmark = pytest.mark.e2e

PROMPTS = [f"job {i}: " + "abcdefgh"[: 1 + i % 8] * (1 + i % 3) for i in range(16)]
BODY = {"max_tokens": 300, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, redis_url, tiny_model):  # type: ignore[no-untyped-def]
    stack = start_stack(
        tmp_path_factory.mktemp("recovery"),
        redis_url=redis_url,
        models={"tiny": tiny_model},
        default_model="tiny",
        args=("--stages", "2"),
        extra_env={"CONVEYOR_TORCH_THREADS": "1", "CONVEYOR_STALL_TIMEOUT_S": "3"},
    )
    yield stack
    stack.stop()


def worker(stack, name: str) -> psutil.Process:  # type: ignore[no-untyped-def]
    for proc in psutil.Process(stack.process.pid).children():
        try:
            line = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if name in line:
            return proc
    raise AssertionError(f"no {name!r} process under the launcher")


def replaced(stack, name: str, old_pid: int, timeout_s: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if worker(stack, name).pid != old_pid:
                return
        except AssertionError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{name!r} was not restarted")


def run_all(client: httpx.Client, *, until_tokens: int | None = None, fault=None) -> list[dict]:  # type: ignore[no-untyped-def,type-arg]
    jobs = [submit(client, prompt=p, **BODY) for p in PROMPTS]
    if fault is not None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # mid-generation: every job started, none near its end
            done = [int(client.get(f"/v1/jobs/{j['id']}").json()["usage"]["completion_tokens"]) for j in jobs]
            if min(done) >= (until_tokens or 1):
                break
            time.sleep(0.02)
        fault()
    return [wait(client, j["id"], timeout_s=180) for j in jobs]


def check_stream(client: httpx.Client, job: dict) -> None:  # type: ignore[type-arg]
    stream = events(client, f"/v1/jobs/{job['id']}/events")
    indices = [e.data["index"] for e in tokens(stream)]
    assert indices == list(range(len(indices))), f"gap or duplicate in {job['id']}: {indices}"
    assert [e.event for e in stream].count("done") == 1 and stream[-1].event == "done"
    assert "".join(e.data["text"] for e in tokens(stream)) == job["text"]
    seen = 0  # each `recovered` event names the index the stream goes on from
    for event in stream:
        if event.event == "token":
            seen += 1
        elif event.event == "recovered":
            assert event.data["index"] == seen, (job["id"], event.data, seen)
    assert sum(e.event == "recovered" for e in stream) == int(job["attempts"])


def test_a_stage_worker_killed_mid_generation_loses_no_job_and_no_token(pipeline):  # type: ignore[no-untyped-def]
    with pipeline.client() as client:
        clean = run_all(client)
        assert all(j["status"] == "succeeded" for j in clean)
        victim = worker(pipeline, "--stage 1")
        faulty = run_all(client, until_tokens=5, fault=lambda: victim.send_signal(signal.SIGKILL))
        replaced(pipeline, "--stage 1", victim.pid)
        assert [j["status"] for j in faulty] == ["succeeded"] * len(PROMPTS), [j.get("error") for j in faulty]
        assert max(int(j["attempts"]) for j in faulty) >= 1, "no job was recovered: the kill came too late"
        assert [j["text"] for j in faulty] == [j["text"] for j in clean]
        for job in faulty:
            check_stream(client, job)
    assert "stage1 exited with code -9" in pipeline.log.read_text()


def test_the_batcher_killed_with_100_jobs_queued_or_in_flight_loses_none(pipeline):  # type: ignore[no-untyped-def]
    with pipeline.client() as client:
        with ThreadPoolExecutor(8) as pool:
            jobs = list(
                pool.map(
                    lambda i: submit(
                        client, prompt=f"burst {i}", max_tokens=20, temperature=0, ignore_eos=True
                    ),
                    range(100),
                )
            )
        victim = worker(pipeline, "app.cli batcher")
        victim.send_signal(signal.SIGKILL)
        replaced(pipeline, "app.cli batcher", victim.pid)
        final = [wait(client, j["id"], timeout_s=180) for j in jobs]
        assert [j["status"] for j in final] == ["succeeded"] * 100
        for job in final:
            stream = events(client, f"/v1/jobs/{job['id']}/events")
            assert [e.event for e in stream].count("done") == 1
            assert [e.data["index"] for e in tokens(stream)] == list(range(20))


def test_a_1000_line_batch_loses_no_line_and_answers_none_twice_when_its_processes_are_killed(pipeline):  # type: ignore[no-untyped-def]
    """The API (which feeds the batch), the batcher and a stage worker SIGKILLed while a batch of 1,000
    lines runs: it completes with 1,000 answers, one per line, in input order."""
    count = 1000
    lines = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {
                "model": "tiny",
                "prompt": f"line {i}:",
                "max_tokens": 4,
                "temperature": 0,
                "ignore_eos": True,
            },
        }
        for i in range(count)
    ]
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()

    def batch_now(client: httpx.Client, batch_id: str) -> dict | None:  # type: ignore[type-arg]
        try:  # the API restarts once: no answer for a moment
            answer = client.get(f"/v1/batches/{batch_id}")
        except httpx.HTTPError:
            return None
        return answer.json() if answer.status_code == 200 else None

    with pipeline.client() as client:
        uploaded = client.post("/v1/files", files={"file": ("in.jsonl", content)}, data={"purpose": "batch"})
        body = {
            "input_file_id": uploaded.json()["id"],
            "endpoint": "/v1/completions",
            "completion_window": "24h",
        }
        batch_id = client.post("/v1/batches", json=body).json()["id"]
        deadline = time.monotonic() + 300
        while (b := batch_now(client, batch_id)) is None or b["request_counts"]["completed"] < 150:
            assert time.monotonic() < deadline, b
            time.sleep(0.1)
        assert b["status"] == "in_progress", b  # killed mid-batch
        for name in ("app.cli batcher", "--stage 1", "app.cli api"):
            victim = worker(pipeline, name)
            victim.send_signal(signal.SIGKILL)
            replaced(pipeline, name, victim.pid)
        deadline = time.monotonic() + 600
        while (b := batch_now(client, batch_id)) is None or b["status"] not in (
            "completed",
            "failed",
            "expired",
        ):
            assert time.monotonic() < deadline, b
            time.sleep(0.2)
        assert b["status"] == "completed", b
        assert b["request_counts"] == {"total": count, "completed": count, "failed": 0}
        assert b["error_file_id"] is None
        output = [
            json.loads(line)
            for line in client.get(f"/v1/files/{b['output_file_id']}/content").text.splitlines()
        ]
    assert [line["custom_id"] for line in output] == [
        f"line-{i}" for i in range(count)
    ]  # each once, in order
    assert len({line["response"]["request_id"] for line in output}) == count
    assert all(line["response"]["status_code"] == 200 for line in output)
    assert all(line["response"]["body"]["usage"]["completion_tokens"] == 4 for line in output)
