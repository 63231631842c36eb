"""The stage worker's runtime in process (tests/stageharness.py): real `StageRuntime`s over the tiny
model and a real Redis, messages passed in memory, so a test can choose the order they arrive in and
what a stage has forgotten. What a client would see is read from the job records and event streams.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from prometheus_client import REGISTRY
from transformers import AutoModelForCausalLM

from app.core.steps import complete
from app.partitions.prefix import PrefixCache
from tests.stageharness import Pipeline, build, reference
from tests.tinyapi import forget_keys

SHORT = [[5, 17, 42, 99], [7, 8, 9]]


@pytest.fixture()
def pipelines(redis):  # type: ignore[no-untyped-def]
    made: list[Pipeline] = []
    yield made
    for pipeline in made:
        forget_keys(redis, pipeline.keys.namespace)


def test_a_batch_run_in_process_matches_generate(redis, tiny_model, pipelines):  # type: ignore[no-untyped-def]
    pipeline = build(redis, tiny_model, stages=2)
    pipelines.append(pipeline)
    jobs = [pipeline.submit(prompt, max_tokens=6) for prompt in SHORT]
    pipeline.dispatch(jobs)
    pipeline.pump()
    for job, prompt in zip(jobs, SHORT, strict=True):
        assert pipeline.record(job)["status"] == "succeeded"
        assert pipeline.tokens(job) == reference(tiny_model, prompt, 6)


def test_a_step_for_a_batch_a_stage_no_longer_holds_fails_no_job(redis, tiny_model, pipelines):  # type: ignore[no-untyped-def]
    """A stage that dropped a batch (no step for `stale_after_s` under load, or a restarted replica)
    and then receives its next step lets the batch go: the other stages free it, its slot is given
    back, and its jobs are recovered and finish, where they used to all fail with `worker_error`."""
    pipeline = build(redis, tiny_model, stages=2)
    pipelines.append(pipeline)
    jobs = [pipeline.submit(prompt, max_tokens=6) for prompt in SHORT]
    pipeline.dispatch(jobs)
    pipeline.pump(until=lambda: all(len(pipeline.tokens(j)) >= 2 for j in jobs))
    pipeline.stages[0].batches.clear()  # stage 0 forgot the batch; its next decode step is queued
    pipeline.pump()

    assert [pipeline.record(j)["status"] for j in jobs] == ["running", "running"]  # none failed
    assert redis.hlen(pipeline.keys.inflight("tiny")) == 0  # the batch's slot is free
    assert not pipeline.stages[1].batches  # stage 1 let it go: no KV cache, no sequences
    assert pipeline.recover_stalled() == dict.fromkeys(jobs, "recovering")
    pipeline.dispatch(jobs)
    pipeline.pump()
    for job, prompt in zip(jobs, SHORT, strict=True):
        assert pipeline.record(job)["status"] == "succeeded"
        assert pipeline.tokens(job) == reference(tiny_model, prompt, 6)  # no gap, no duplicate


@pytest.mark.parametrize(("budget", "joins"), [(4096, True), (64, False)])
def test_a_join_stays_inside_the_kv_budget(redis, tiny_model, pipelines, budget, joins):  # type: ignore[no-untyped-def]
    """A long prompt joins a running batch of short ones only if rows x padded positions of the
    merged batch fit `max_kv_positions`; otherwise it runs as its own batch. Outputs are the same."""
    pipeline = build(redis, tiny_model, stages=1, max_kv_positions=budget)
    pipelines.append(pipeline)
    running = [pipeline.submit(prompt, max_tokens=12) for prompt in SHORT]
    pipeline.dispatch(running)
    pipeline.pump(steps=3)
    long_prompt = [(i * 7) % 200 + 3 for i in range(100)]
    joiner = pipeline.submit(long_prompt, max_tokens=4)
    joiner_batch = pipeline.dispatch([joiner])
    pipeline.pump()

    merged = [m for m in pipeline.delivered if joiner_batch in m.merge]
    assert bool(merged) is joins  # 3 rows x 101 positions = 303: over 64, under 4096
    assert pipeline.tokens(joiner) == reference(tiny_model, long_prompt, 4)
    for job, prompt in zip(running, SHORT, strict=True):
        assert pipeline.tokens(job) == reference(tiny_model, prompt, 12)


def test_a_seeded_job_recovered_partway_continues_as_if_never_interrupted(redis, tiny_model: Path, pipelines):  # type: ignore[no-untyped-def]
    """Sampled with a seed, a job whose worker died after 4 tokens and that was recovered onto a
    fresh worker streams the same tokens as the same request run without interruption."""
    request = {"temperature": 1.0, "seed": 1234, "max_tokens": 10}
    pipeline = build(redis, tiny_model, stages=1)
    pipelines.append(pipeline)
    whole = pipeline.submit(SHORT[0], **request)
    pipeline.dispatch([whole])
    pipeline.pump()
    expected = pipeline.tokens(whole)
    assert len(expected) == 10

    interrupted = pipeline.submit(SHORT[0], **request)
    pipeline.dispatch([interrupted])
    pipeline.pump(until=lambda: len(pipeline.tokens(interrupted)) >= 4)
    pipeline.outbox.clear()  # the worker died with the batch's next step
    assert pipeline.recover_stalled() == {interrupted: "recovering"}
    fresh = build(redis, tiny_model, stages=1, namespace=pipeline.keys.namespace)  # another worker
    fresh.dispatch([interrupted])
    fresh.pump()

    assert fresh.record(interrupted)["status"] == "succeeded"
    assert fresh.record(interrupted)["attempts"] == "1"
    assert fresh.tokens(interrupted) == expected
    events = fresh.events(interrupted)
    names = [name for name, _ in events]
    at = names.index("recovered")  # once, between the 4 tokens before and the 6 after
    assert names.count("recovered") == 1 and events[at][1] == {"index": 4, "attempt": 1}
    assert [data["index"] for name, data in events[at + 1 :] if name == "token"] == list(range(4, 10))


def test_a_failing_batch_fails_only_the_jobs_it_still_holds(redis, tiny_model, pipelines):  # type: ignore[no-untyped-def]
    """A batch whose step raises fails its jobs, but not one recovered meanwhile: a job re-queued
    (`recovering`) or already running in another batch has left it and goes on there."""
    old = build(redis, tiny_model, stages=1)
    pipelines.append(old)
    moved, requeued = (old.submit(prompt, max_tokens=6) for prompt in SHORT)
    old.dispatch([moved, requeued])
    old.pump(until=lambda: len(old.tokens(moved)) >= 2)
    assert old.recover_stalled() == {moved: "recovering", requeued: "recovering"}
    new = build(redis, tiny_model, stages=1, namespace=old.keys.namespace)  # another worker
    new.dispatch([moved])
    new.pump(steps=2)  # `moved` runs in its new batch
    assert new.record(moved)["status"] == "running"

    [step] = old.outbox  # the old batch's next step, which now fails on its stage
    old.outbox[0] = step.forward(tensors={"input_ids": {"broken": True}})
    old.pump()

    assert old.record(requeued)["status"] == "recovering"  # waiting to run again, not failed
    new.pump()
    assert new.record(moved)["status"] == "succeeded"
    assert new.tokens(moved) == reference(tiny_model, SHORT[0], 6)


def test_a_finished_row_leaves_the_batch_and_the_others_go_on(redis, tiny_model, pipelines):  # type: ignore[no-untyped-def]
    """Rows of one batch with different lengths: the short job ends, its row leaves every stage's
    state at the next step (the KV cache shrinks), and the long one finishes as if alone."""
    pipeline = build(redis, tiny_model, stages=2)
    pipelines.append(pipeline)
    short, long = pipeline.submit(SHORT[0], max_tokens=3), pipeline.submit(SHORT[1], max_tokens=9)
    batch = pipeline.dispatch([short, long])
    pipeline.pump(until=lambda: pipeline.record(short)["status"] == "succeeded")
    pipeline.pump(steps=2)  # the next step reaches both stages

    for stage in pipeline.stages:
        running = stage.batches.get(batch)
        assert running is not None and running.state.seq_ids == [long]
        assert all(slab.rows == 1 for slab in running.state.slabs if slab._k is not None)
    pipeline.pump()
    assert pipeline.tokens(short) == reference(tiny_model, SHORT[0], 3)
    assert pipeline.tokens(long) == reference(tiny_model, SHORT[1], 9)
    assert pipeline.record(long)["status"] == "succeeded"
    assert all(not stage.batches.get(batch) for stage in pipeline.stages)  # the batch is gone


def test_a_cancelled_job_leaves_its_batch_and_its_neighbour_finishes(redis, redis_url, tiny_model, pipelines):  # type: ignore[no-untyped-def]
    """A job cancelled (as `DELETE /v1/jobs/{id}` does it) while its batch runs: no token after the
    cancel, its final event says cancelled, its row leaves, and the other job's tokens are unchanged."""
    import asyncio

    import redis.asyncio as aredis

    from app.core.jobstore import AsyncJobStore, Lifetimes

    pipeline = build(redis, tiny_model, stages=2)
    pipelines.append(pipeline)
    victim, neighbour = (pipeline.submit(prompt, max_tokens=10) for prompt in SHORT)
    batch = pipeline.dispatch([victim, neighbour])
    pipeline.pump(until=lambda: len(pipeline.tokens(victim)) >= 3)

    async def cancel() -> tuple[bool, str]:
        client = aredis.Redis.from_url(redis_url)
        try:
            store = AsyncJobStore(client, pipeline.keys)
            return await store.cancel(victim, reason="the user cancelled", life=Lifetimes(600, 600, 1000))
        finally:
            await client.aclose()

    assert asyncio.run(cancel()) == (True, "running")
    streamed = len(pipeline.tokens(victim))
    pipeline.pump()

    assert pipeline.record(victim)["status"] == "cancelled"
    assert len(pipeline.tokens(victim)) == streamed  # nothing after the cancel
    names = [name for name, _ in pipeline.events(victim)]
    assert names[-1] == "cancelled" and names.count("cancelled") == 1  # its one final event, last
    assert pipeline.record(neighbour)["status"] == "succeeded"
    assert pipeline.tokens(neighbour) == reference(tiny_model, SHORT[1], 10)
    assert all(not stage.batches.get(batch) for stage in pipeline.stages)


def _newcomer_beside_a_running_batch(redis, tiny_model, pipelines):  # type: ignore[no-untyped-def]
    """One stage; a job running 3 steps in, and a newcomer dispatched (its prefill last in the outbox,
    the running batch's next step first). Returns the pipeline, both job ids, the newcomer's batch."""
    pipeline = build(redis, tiny_model, stages=1)
    pipelines.append(pipeline)
    running = pipeline.submit(SHORT[0], max_tokens=8)
    pipeline.dispatch([running])
    pipeline.pump(steps=3)
    newcomer = pipeline.submit(SHORT[1], max_tokens=4)
    return pipeline, running, newcomer, pipeline.dispatch([newcomer])


def test_an_urgent_prefill_runs_between_two_layers_of_a_running_step(redis, tiny_model, pipelines):  # type: ignore[no-untyped-def]
    """A running batch's step suspended after its first layer (`StageRuntime.run` yields there; the
    worker's compute thread runs urgent work at that point): the urgent job's prefill runs whole and
    streams its first token, then the suspended step goes on; both jobs' tokens are what each would
    be alone."""
    pipeline, running, newcomer, _ = _newcomer_beside_a_running_batch(redis, tiny_model, pipelines)
    urgent = pipeline.outbox.pop()  # its prefill waits as urgent work, not in the queue
    streamed = len(pipeline.tokens(running))

    step = pipeline.stages[0].run(pipeline.outbox.popleft())  # the running batch's next step
    next(step)  # its first layer ran; it is suspended
    pipeline.stages[0].handle(urgent)
    assert len(pipeline.tokens(newcomer)) == 1  # the newcomer's first token came mid-step
    assert len(pipeline.tokens(running)) == streamed
    complete(step)
    assert len(pipeline.tokens(running)) == streamed + 1  # and the step went on to its token
    pipeline.pump()
    assert pipeline.tokens(running) == reference(tiny_model, SHORT[0], 8)
    assert pipeline.tokens(newcomer) == reference(tiny_model, SHORT[1], 4)


def test_a_running_batch_steps_between_two_layers_of_a_new_batchs_prefill(redis, tiny_model, pipelines):  # type: ignore[no-untyped-def]
    """A prefill suspended after its first layer (the compute thread lets waiting decode steps run
    there once a prefill has run a slice): the running batch's decode step runs whole in between,
    the prefill goes on, and the new batch still joins the running one; every job's tokens are
    what it would get alone."""
    pipeline, running, newcomer, newcomer_batch = _newcomer_beside_a_running_batch(
        redis, tiny_model, pipelines
    )
    prefill = pipeline.outbox.pop()
    streamed = len(pipeline.tokens(running))

    steps = pipeline.stages[0].run(prefill)
    next(steps)  # its first layer ran; it is suspended
    pipeline.pump(steps=1)  # the running batch's decode step
    assert len(pipeline.tokens(running)) == streamed + 1 and not pipeline.tokens(newcomer)
    complete(steps)
    assert len(pipeline.tokens(newcomer)) == 1
    pipeline.pump()
    assert any(newcomer_batch in m.merge for m in pipeline.delivered)  # it joined the running batch
    assert pipeline.tokens(running) == reference(tiny_model, SHORT[0], 8)
    assert pipeline.tokens(newcomer) == reference(tiny_model, SHORT[1], 4)


def test_a_prompt_starting_like_an_earlier_one_reuses_its_prefix_on_every_stage(redis, tiny_model, pipelines):  # type: ignore[no-untyped-def]
    """Two stages with prefix caches: a second job sharing the first one's 32-token start computes
    only its own tail on each stage (stage 1 learns the prompt's ids from stage 0's message) and
    streams what `generate` gives for its whole prompt; so does a job run while stage 1 misses."""
    pipeline = build(redis, tiny_model, stages=2, prefix_cache_mb=16)
    pipelines.append(pipeline)
    system = [(i * 13) % 150 + 3 for i in range(40)]
    prompts = [system + [5, 6], system + [7, 8, 9, 10], system[:35] + [11]]
    runs = []
    for number, prompt in enumerate(prompts):
        if number == 2:
            pipeline.stages[1].prefixes = PrefixCache(2**24)  # stage 1 restarted: it misses
        before = [_reused(pipeline, stage) for stage in (0, 1)]
        job = pipeline.submit(prompt, max_tokens=5)
        pipeline.dispatch([job])
        pipeline.pump()
        runs.append([_reused(pipeline, stage) - b for stage, b in zip((0, 1), before, strict=True)])
        assert pipeline.record(job)["status"] == "succeeded"
        assert pipeline.tokens(job) == reference(tiny_model, prompt, 5)
    assert runs == [[0, 0], [32, 32], [32, 0]]


def _reused(pipeline: Pipeline, stage: int) -> float:
    return (
        REGISTRY.get_sample_value(
            "conveyor_prefix_cache_tokens_total", {"model": "tiny", "stage": str(stage), "source": "cache"}
        )
        or 0.0
    )


def test_prompt_logprobs_come_once_whole_past_a_prefix_cache_hit_and_a_recovery(
    redis, tiny_model: Path, pipelines
):  # type: ignore[no-untyped-def]
    """Echo's prompt logprobs: a `prompt` event before the first token, the model's log-softmax at
    every prompt position, though the prompt's prefix is in both stages' caches (the last stage
    computes it whole); a job recovered after its first tokens gets no second one."""
    prompt = list(range(5, 45))  # 40 tokens: two whole blocks of the prefix cache
    pipeline = build(redis, tiny_model, stages=2, prefix_cache_mb=8)
    pipelines.append(pipeline)
    warm = pipeline.submit(prompt, max_tokens=2)
    pipeline.dispatch([warm])
    pipeline.pump()
    job = pipeline.submit(prompt, max_tokens=8, prompt_logprobs=2)
    pipeline.dispatch([job])
    pipeline.pump(until=lambda: len(pipeline.tokens(job)) >= 3)
    pipeline.outbox.clear()  # the worker died with the batch's next step
    assert pipeline.recover_stalled() == {job: "recovering"}
    fresh = build(redis, tiny_model, stages=2, namespace=pipeline.keys.namespace, prefix_cache_mb=8)
    fresh.dispatch([job])
    fresh.pump()

    assert fresh.record(job)["status"] == "succeeded" and len(fresh.tokens(job)) == 8
    kinds = [kind for kind, _ in fresh.events(job)]
    assert kinds.count("prompt") == 1 and kinds.index("prompt") < kinds.index("token")
    (entries,) = [data["prompt_logprobs"] for kind, data in fresh.events(job) if kind == "prompt"]
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(dim=-1)  # [39, V]
    assert len(entries) == len(prompt) - 1
    for i, (logprob, top) in enumerate(entries):
        assert abs(logprob - float(want[i, prompt[i + 1]])) < 1e-3
        assert [t for t, _ in top] == want[i].topk(2).indices.tolist()
