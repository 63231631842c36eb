"""Pipelines on the step engine (`CONVEYOR_ENGINE=step`), in process (tests/harness.py): jobs the
batcher dispatches are admitted into stage 0's scheduler, whose ragged steps give the tokens of
`generate` in 1, 2 and 3 stages (a plan in flight per stage), with prompts longer than a step's
token budget (chunked prefill) and jobs arriving while others decode; echo's prompt logprobs are
the model's log-softmax over chunked prompts; a cancelled job leaves and the others go on; a step
that raises, on stage 0 or a later stage, fails its jobs with the reason and the pipeline goes on;
a prompt seen before takes its cached blocks (and the prefix cache's metrics count them)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from clients import TERMINAL, events, submit, tokens, wait
from harness import harness
from integration.test_generation import reference_tokens
from integration.test_openai_choices import reference
from transformers import AutoTokenizer

from app.core.credit import ReplicaCredit
from app.workers import echo
from app.workers.engine import runtime as engine_runtime

# A step of at most 16 tokens, 4 sequences at once: the longer prompts arrive in chunks, and the
# fifth and sixth jobs wait for a sequence to end.
ENGINE = {
    "CONVEYOR_ENGINE": "step",
    "CONVEYOR_MAX_PREFILL_TOKENS": "16",
    "CONVEYOR_MAX_RUNNING_SEQUENCES": "4",
}
PROMPTS = [
    "one two three",
    "the quick brown fox jumps over the lazy dog and then it runs far away into the forest",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z",
    "hello",
    "numbers: 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
    "tell me a story",
]


def engine_stack(tmp_path, redis_url, tiny_model, stages: int = 1, **kwargs):  # type: ignore[no-untyped-def]
    """The in-process stack serving the tiny model on the step engine, in `stages` stages."""
    return harness(
        tmp_path,
        redis_url=redis_url,
        models={"tiny": tiny_model},
        default_model="tiny",
        extra_env={**ENGINE, "CONVEYOR_STAGES": str(stages)},
        **kwargs,
    )


def greedy(client, prompt: str, max_tokens: int):  # type: ignore[no-untyped-def]
    job = submit(client, prompt=prompt, max_tokens=max_tokens, temperature=0)
    stream = events(client, job["urls"]["events"])
    return stream[-1].data, [e.data["token_id"] for e in tokens(stream)]


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_jobs_on_the_step_engine_stream_the_tokens_of_generate(tmp_path, redis_url, tiny_model, stages):  # type: ignore[no-untyped-def]
    lengths = [24, 9, 17, 30, 5, 12]  # they leave at different steps
    with (
        engine_stack(tmp_path, redis_url, tiny_model, stages) as stack,
        stack.client() as client,
        ThreadPoolExecutor(len(PROMPTS)) as pool,
    ):
        results = list(pool.map(lambda a: greedy(client, *a), zip(PROMPTS, lengths, strict=True)))
    for prompt, n, (job, got) in zip(PROMPTS, lengths, results, strict=True):
        assert job["status"] == "succeeded", job
        assert got == reference_tokens(tiny_model, prompt, n), prompt
        assert job["usage"]["completion_tokens"] == len(got)


@pytest.mark.parametrize("cache_mb", ["256", "0"], ids=["cached", "off"])
def test_a_prompt_seen_before_takes_its_cached_blocks_and_the_metrics_say_so(  # type: ignore[no-untyped-def]
    tmp_path, redis_url, tiny_model, cache_mb
):
    """The step engine's prefix cache is counted as the batch engine's is (the dashboard's panel):
    the second job of the same prompt reuses its whole blocks, computes only the rest, and streams
    the same tokens; with CONVEYOR_PREFIX_CACHE_MB=0 it computes the whole prompt again."""
    from prometheus_client import REGISTRY

    def counted(source: str) -> float:
        labels = {"model": "tiny", "stage": "0", "source": source}
        return REGISTRY.get_sample_value("conveyor_prefix_cache_tokens_total", labels) or 0.0

    prompt = PROMPTS[1]  # longer than two blocks of 16 tokens
    runs = []
    env = {**ENGINE, "CONVEYOR_PREFIX_CACHE_MB": cache_mb}
    with (
        harness(
            tmp_path, redis_url=redis_url, models={"tiny": tiny_model}, default_model="tiny", extra_env=env
        ) as stack,
        stack.client() as client,
    ):
        for _ in range(2):
            before = counted("cache"), counted("computed")
            job, got = greedy(client, prompt, 6)
            runs.append((counted("cache") - before[0], counted("computed") - before[1], got))
    (cached_first, computed_first, first), (cached_second, computed_second, second) = runs
    assert cached_first == 0 and computed_first >= 33
    if cache_mb == "0":
        assert (cached_second, computed_second) == (0, computed_first)
    else:
        assert cached_second >= 32 and cached_second % 16 == 0
        assert cached_second + computed_second == computed_first  # the same prompt, split otherwise
    assert first == second == reference_tokens(tiny_model, prompt, 6)


@pytest.mark.parametrize("stages", [1, 2])
def test_a_cancelled_job_leaves_the_engine_and_the_others_finish(tmp_path, redis_url, tiny_model, stages):  # type: ignore[no-untyped-def]
    with (
        engine_stack(tmp_path, redis_url, tiny_model, stages) as stack,
        stack.client() as client,
    ):
        long = submit(client, prompt="one two three", max_tokens=400, temperature=0, ignore_eos=True)
        other = submit(client, prompt="hello there", max_tokens=12, temperature=0, ignore_eos=True)
        deadline = time.monotonic() + 60
        while client.get(f"/v1/jobs/{long['id']}").json()["usage"]["completion_tokens"] < 2:
            assert time.monotonic() < deadline, "the long job did not start"
            time.sleep(0.05)
        assert client.post(f"/v1/jobs/{long['id']}/cancel").status_code in (200, 202)
        cancelled = wait(client, long["id"])
        done = wait(client, other["id"])
        runtime = stack.runtimes[("tiny", 0, 0)]
        deadline = time.monotonic() + 30
        while runtime.busy:  # the cancelled job's sequence leaves at its next step
            assert time.monotonic() < deadline, "the cancelled job still holds the engine"
            time.sleep(0.05)
    assert cancelled["status"] == "cancelled", cancelled
    assert cancelled["usage"]["completion_tokens"] < 400
    assert done["status"] == "succeeded", done
    assert done["usage"]["completion_tokens"] == 12


@pytest.mark.parametrize("stages", [1, 2])
def test_echo_on_the_step_engine_gives_the_prompts_log_softmax(tmp_path, redis_url, tiny_model, stages):  # type: ignore[no-untyped-def]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    prompt = PROMPTS[1]  # several chunks of the step's 16 tokens
    ids = tokenizer(prompt).input_ids
    want = reference(tiny_model, ids)  # [L - 1, V]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "echo": True, "logprobs": 2, "temperature": 0}
    with (
        engine_stack(tmp_path, redis_url, tiny_model, stages) as stack,
        stack.client() as client,
        ThreadPoolExecutor(3) as pool,
    ):
        # one beside two plain jobs, then again: its blocks are cached now, and still computed
        beside = [pool.submit(greedy, client, p, 8) for p in PROMPTS[2:4]]
        answers = [client.post("/v1/completions", json=body) for _ in range(2)]
        plain = [f.result() for f in beside]
    for response in answers:
        assert response.status_code == 200, response.text
        logprobs = response.json()["choices"][0]["logprobs"]
        prompt_lps = logprobs["token_logprobs"][: len(ids)]
        assert prompt_lps[0] is None
        pairs = enumerate(zip(prompt_lps[1:], ids[1:], strict=True))
        assert all(abs(lp - float(want[i, t])) < 1e-3 for i, (lp, t) in pairs)
        for i, top in enumerate(logprobs["top_logprobs"][1 : len(ids)]):
            assert {tokenizer.decode([int(t)]) for t in want[i].topk(2).indices} <= set(top)
        assert len(logprobs["tokens"]) == len(ids) + 3
    for p, (job, got) in zip(PROMPTS[2:4], plain, strict=True):
        assert job["status"] == "succeeded" and got == reference_tokens(tiny_model, p, 8)


@pytest.mark.parametrize("stages", [1, 2])
def test_an_echo_that_cannot_be_computed_fails_its_job_alone(  # type: ignore[no-untyped-def]
    tmp_path, redis_url, tiny_model, monkeypatch, stages
):
    def broken(*args):  # type: ignore[no-untyped-def]
        raise RuntimeError("the head failed")

    monkeypatch.setattr(echo, "prompt_logprobs", broken)
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 3, "echo": True, "logprobs": 1}
    with (
        engine_stack(tmp_path, redis_url, tiny_model, stages) as stack,
        stack.client() as client,
        ThreadPoolExecutor(1) as pool,
    ):
        beside = pool.submit(greedy, client, PROMPTS[3], 6)
        response = client.post("/v1/completions", json=body)
        job, got = beside.result()
    assert response.status_code >= 500 and "the head failed" in response.text, response.text
    assert job["status"] == "succeeded" and got == reference_tokens(tiny_model, PROMPTS[3], 6)


def test_a_step_that_fails_on_a_later_stage_fails_its_jobs_with_the_reason_and_the_pipeline_goes_on(  # type: ignore[no-untyped-def]
    tmp_path, redis_url, tiny_model, monkeypatch
):
    """Stage 1 of 2 raises in a step: stage 0 hears it and fails the jobs it held with the reason
    (stage 1's), starts again with none, and the next job streams generate's tokens."""
    from app.partitions import ragged

    forward, calls = ragged.forward, []

    def broken(stage, *args, **kwargs):  # type: ignore[no-untyped-def]
        if not stage.is_first:
            calls.append(stage)
            if len(calls) == 1:
                raise RuntimeError("a kernel failed")
        return forward(stage, *args, **kwargs)

    monkeypatch.setattr(ragged, "forward", broken)
    with (
        engine_stack(tmp_path, redis_url, tiny_model, 2) as stack,
        stack.client() as client,
    ):
        failed = wait(client, submit(client, prompt="one two three", max_tokens=5, temperature=0)["id"])
        after = greedy(client, "one two three", 5)
    assert failed["status"] == "failed", failed
    assert failed["error"]["code"] == "worker_error"
    assert "stage 1 failed" in failed["error"]["message"] and "a kernel failed" in failed["error"]["message"]
    assert after[0]["status"] == "succeeded"
    assert after[1] == reference_tokens(tiny_model, "one two three", 5)


def test_a_step_that_raises_fails_its_jobs_with_a_reason_and_the_engine_goes_on(
    tmp_path, redis_url, tiny_model
):  # type: ignore[no-untyped-def]
    with (
        engine_stack(tmp_path, redis_url, tiny_model) as stack,
        stack.client() as client,
    ):
        runtime = next(iter(stack.runtimes.values()))
        run, calls = runtime.loop.run, []

        def broken(plan, *args):  # type: ignore[no-untyped-def]
            calls.append(plan)
            if len(calls) == 1:
                raise RuntimeError("a kernel failed")
            return run(plan, *args)

        runtime.loop.run = broken
        failed = wait(client, submit(client, prompt="one two three", max_tokens=5, temperature=0)["id"])
        after = greedy(client, "one two three", 5)
    assert failed["status"] == "failed", failed
    assert failed["error"]["code"] == "worker_error"
    assert "a kernel failed" in failed["error"]["message"]
    assert after[0]["status"] == "succeeded"
    assert after[1] == reference_tokens(tiny_model, "one two three", 5)


def test_a_failed_step_whose_jobs_cannot_be_failed_leaves_them_to_recovery_and_the_engine_goes_on(
    tmp_path, redis_url, tiny_model
):  # type: ignore[no-untyped-def]
    """Redis away just as a step fails: its job cannot be failed, so it stays running; the engine's
    steps go on (a later job is served) and the recovery monitor runs the first job again: both end
    with generate's tokens. (The pump once died here and every later job stalled.)"""
    import redis as redis_lib

    env = {**ENGINE, "CONVEYOR_STALL_TIMEOUT_S": "2"}
    with (
        harness(
            tmp_path, redis_url=redis_url, models={"tiny": tiny_model}, default_model="tiny", extra_env=env
        ) as stack,
        stack.client() as client,
    ):
        runtime = next(iter(stack.runtimes.values()))
        run, fail, calls = runtime.loop.run, runtime.outcomes.fail, []

        def broken(plan, *args):  # type: ignore[no-untyped-def]
            calls.append(plan)
            if len(calls) == 1:
                raise redis_lib.ConnectionError("Connection reset by peer")
            return run(plan, *args)

        def unreachable(*args, **kwargs):  # type: ignore[no-untyped-def]
            runtime.outcomes.fail = fail
            raise redis_lib.ConnectionError("Error 111 connecting: Connection refused")

        runtime.loop.run, runtime.outcomes.fail = broken, unreachable
        first = submit(client, prompt="one two three", max_tokens=5, temperature=0)
        later = greedy(client, "hello", 4)
        recovered = wait(client, first["id"], timeout_s=60)
        streamed = [e.data["token_id"] for e in tokens(events(client, first["urls"]["events"]))]
    assert later[0]["status"] == "succeeded" and later[1] == reference_tokens(tiny_model, "hello", 4)
    assert recovered["status"] == "succeeded", recovered
    assert int(recovered["attempts"]) >= 1
    assert streamed == reference_tokens(tiny_model, "one two three", 5)


def test_the_batcher_sends_the_engine_only_the_prompts_its_kv_cache_holds(
    tmp_path, redis_url, tiny_model, monkeypatch
):  # type: ignore[no-untyped-def]
    """The replica advertises its free KV blocks (app/core/credit.py): a cache of 4 blocks of 16
    holds two of these prompts (21-23 tokens and a first token: 2 blocks each), so the batcher
    sends two and keeps the others queued, where priorities and fair share still order them, until
    blocks free; every job still streams the tokens of `generate`."""
    prompts = [
        "the cat sat on the mat",
        "a dog ran in the park",
        "one two three four five",
        "red green blue yellow",
    ]
    env = {**ENGINE, "CONVEYOR_MAX_BATCH_KV_POSITIONS": "64", "CONVEYOR_MAX_WAIT_MS": "0"}  # no window
    with (
        harness(
            tmp_path,
            redis_url=redis_url,
            models={"tiny": tiny_model},
            default_model="tiny",
            extra_env=env,
            batcher="tick",
        ) as stack,
        stack.client() as client,
    ):
        jobs = [submit(client, prompt=p, max_tokens=4, temperature=0, ignore_eos=True) for p in prompts]
        stack.tick()
        first = [client.get(f"/v1/jobs/{job['id']}").json() for job in jobs]
        assert [j["status"] == "queued" for j in first].count(True) == 2, first
        deadline = time.monotonic() + 120
        while any(client.get(f"/v1/jobs/{job['id']}").json()["status"] not in TERMINAL for job in jobs):
            assert time.monotonic() < deadline, "the queued jobs were never sent"
            stack.tick()
        results = [(wait(client, job["id"]), events(client, job["urls"]["events"])) for job in jobs]
        # idle again, it says its whole credit again now and then (its key must not expire)
        runtime = next(iter(stack.runtimes.values()))
        said: list[ReplicaCredit] = []
        runtime.advertise = said.append
        monkeypatch.setattr(engine_runtime, "CREDIT_REFRESH_S", 0.0)
        runtime.refresh_credit()
    assert said == [ReplicaCredit(4, 4, block_size=16, max_sequences=4, received=said[0].received)]
    assert len(said[0].received) >= 2  # the batches it was sent (two at least: 4 blocks, 2 each)
    for prompt, (job, stream) in zip(prompts, results, strict=True):
        assert job["status"] == "succeeded", job
        assert 20 <= job["usage"]["prompt_tokens"] <= 30  # 2 blocks each, as the docstring counts
        assert [e.data["token_id"] for e in tokens(stream)] == reference_tokens(tiny_model, prompt, 4)
