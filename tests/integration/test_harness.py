"""The in-process stack itself (tests/harness.py): a batcher the test ticks dispatches only when
ticked, and what it dispatches runs on the stage replicas to the same tokens a whole stack streams."""

from __future__ import annotations

import time

from clients import events, submit, tokens, wait
from harness import harness
from integration.test_generation import reference_tokens


def test_a_ticked_batcher_dispatches_only_when_ticked(tmp_path, redis_url, tiny_model):  # type: ignore[no-untyped-def]
    with (
        harness(
            tmp_path, redis_url=redis_url, models={"tiny": tiny_model}, default_model="tiny", batcher="tick"
        ) as stack,
        stack.client() as client,
    ):
        job = submit(client, prompt="one two three", max_tokens=6, temperature=0, ignore_eos=True)
        time.sleep(0.5)  # nothing is dispatched without a tick, however long one waits
        assert client.get(f"/v1/jobs/{job['id']}").json()["status"] == "queued"
        deadline = time.monotonic() + 60
        while client.get(f"/v1/jobs/{job['id']}").json()["status"] == "queued":
            assert time.monotonic() < deadline, "a tick did not dispatch the queued job"
            stack.tick()
        done = wait(client, job["id"])
        stream = events(client, job["urls"]["events"])
    assert done["status"] == "succeeded", done
    assert [e.data["token_id"] for e in tokens(stream)] == reference_tokens(tiny_model, "one two three", 6)
