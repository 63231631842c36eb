"""A one-stage pipeline on the step engine (`CONVEYOR_ENGINE=step`) as `conveyor up` runs it: its
worker process admits batches between the loop's steps, and SIGKILLed mid-generation it loses no
job and no token: the jobs are recovered, and their text is what a clean run gives. Its restarted
process advertises its credit to the batcher (app/core/credit.py) as the first did."""

from __future__ import annotations

import signal
import time

import pytest
import redis as redis_lib
from conftest import start_stack
from e2e.test_recovery import PROMPTS, check_stream, replaced, run_all, worker

from app.core.credit import live_credits
from app.core.keys import Keys

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
        # the restarted replica reports its credit, all of it free (the killed one's last report counts
        # until its heartbeat lapses, heartbeat_ttl_s after its last beat, as the census counts it)
        reports = live_credits(
            redis_lib.Redis.from_url(redis_url), Keys(stack.namespace), ["tiny"], since=time.time() - 10
        )
        assert (64, 64) in [(c.sequences, c.max_sequences) for c in reports["tiny"]], reports
        log = stack.log.read_text()
        assert "engine step" in log
        assert "stage0 exited with code -9" in log
    finally:
        stack.stop()
