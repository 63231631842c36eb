"""A one-stage pipeline on the step engine (`CONVEYOR_ENGINE=step`) as `conveyor up` runs it: its
worker process admits batches between the loop's steps, and SIGKILLed mid-generation it loses no
job and no token: the jobs are recovered, and their text is what a clean run gives."""

from __future__ import annotations

import signal

import pytest
from conftest import start_stack
from e2e.test_recovery import PROMPTS, check_stream, replaced, run_all, worker

pytestmark = pytest.mark.e2e


def test_a_step_engine_worker_killed_mid_generation_loses_no_job_and_no_token(  # type: ignore[no-untyped-def]
    tmp_path, redis_url, tiny_model
):
    stack = start_stack(
        tmp_path,
        redis_url=redis_url,
        models={"tiny": tiny_model},
        default_model="tiny",
        extra_env={
            "CONVEYOR_ENGINE": "step",
            "CONVEYOR_TORCH_THREADS": "1",
            "CONVEYOR_STALL_TIMEOUT_S": "3",
            "CONVEYOR_MAX_PREFILL_TOKENS": "32",
        },
    )
    try:
        with stack.client() as client:
            clean = run_all(client)
            assert all(j["status"] == "succeeded" for j in clean), [j.get("error") for j in clean]
            victim = worker(stack, "--stage 0")
            faulty = run_all(client, until_tokens=5, fault=lambda: victim.send_signal(signal.SIGKILL))
            replaced(stack, "--stage 0", victim.pid)
            assert [j["status"] for j in faulty] == ["succeeded"] * len(PROMPTS), [
                j.get("error") for j in faulty
            ]
            assert max(int(j["attempts"]) for j in faulty) >= 1, (
                "no job was recovered: the kill came too late"
            )
            assert [j["text"] for j in faulty] == [j["text"] for j in clean]
            for job in faulty:
                check_stream(client, job)
        log = stack.log.read_text()
        assert "engine step" in log
        assert "stage0 exited with code -9" in log
    finally:
        stack.stop()
