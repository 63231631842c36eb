"""Jobs through the real pipeline: api -> Redis intake -> batcher -> Celery worker -> Redis -> client."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis as redis_lib
import torch
from clients import events, submit, tokens, wait
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPTS = [
    "Hi",
    "The quick brown fox jumps over the lazy dog.",
    "A somewhat longer prompt, so that the batch needs left padding: " + "la " * 12,
    "Short one.",
]


def reference_tokens(model_dir: Path, prompt: str, max_new_tokens: int) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.tensor([tokenizer(prompt).input_ids])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens
    )[0, ids.shape[1] :].tolist()
    return [t for t in out if t != tokenizer.eos_token_id]


def run_greedy(client, prompt: str, max_tokens: int) -> tuple[dict, list]:  # type: ignore[no-untyped-def]
    job = submit(client, prompt=prompt, max_tokens=max_tokens, temperature=0)
    return follow(client, job)


def follow(client, job: dict) -> tuple[dict, list]:  # type: ignore[no-untyped-def]
    stream = events(client, job["urls"]["events"])
    return stream[-1].data, stream


def test_greedy_batch_equals_generate_token_for_token(stack, tiny_model):  # type: ignore[no-untyped-def]
    with stack.client() as client, ThreadPoolExecutor(len(PROMPTS)) as pool:
        with stack.held():  # submitted together, whatever the machine's load: one round takes them
            jobs = [submit(client, prompt=p, max_tokens=24, temperature=0) for p in PROMPTS]
        results = list(pool.map(lambda job: follow(client, job), jobs))
    for prompt, (job, stream) in zip(PROMPTS, results, strict=True):
        assert job["status"] == "succeeded", job
        got = [e.data["token_id"] for e in tokens(stream)]
        assert got == reference_tokens(tiny_model, prompt, 24), prompt
        assert job["usage"]["completion_tokens"] == len(got)
    assert max(job["batch"]["size"] for job, _ in results) > 1, "prompts submitted together share a batch"


def joins_running_batch(  # type: ignore[no-untyped-def]
    client, redis, namespace: str, model_dir: Path, *, hosts: int = 1, batches: bool = True
) -> None:
    """Long jobs run, one batch per stage (a pipeline keeps that many circulating); two jobs
    submitted meanwhile join one of those batches (with `batches`: the batch engine's; the step
    engine's sequences share steps without batches, and finish first here); every token equals
    generate()."""
    long_prompts = [f"A long running job {i}" for i in range(hosts)]
    late = ["late joiner number one", "ok"]
    running = []
    for prompt in long_prompts:  # one after another: each gets a batch of its own
        running.append(submit(client, prompt=prompt, max_tokens=160, temperature=0, ignore_eos=True))
        assert len(events(client, running[-1]["urls"]["events"], max_tokens=3)) == 3  # it is running now
    with ThreadPoolExecutor(2) as pool:
        joined = list(pool.map(lambda p: run_greedy(client, p, 12), late))
    host_batches = set()
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    for prompt, job in zip(long_prompts, running, strict=True):
        stream = events(client, job["urls"]["events"])
        host_batches.add(stream[-1].data["batch"]["id"])
        ids = AutoTokenizer.from_pretrained(model_dir)(prompt).input_ids
        ref = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=160, min_new_tokens=160)
        assert [e.data["token_id"] for e in tokens(stream)] == ref[0, len(ids) :].tolist()
    for prompt, (job, stream) in zip(late, joined, strict=True):
        assert job["status"] == "succeeded"
        assert [e.data["token_id"] for e in tokens(stream)] == reference_tokens(model_dir, prompt, 12)
    if not batches:  # the late jobs ran beside the long ones: they ended before them
        ended = [wait(client, job["id"])["timings"]["finished_at"] for job in running]
        assert max(job["timings"]["finished_at"] for job, _ in joined) < min(ended)
        return
    late_batches = {job["batch"]["id"] for job, _ in joined}
    log = [{k.decode(): v.decode() for k, v in f.items()} for _, f in redis.xrange(f"{namespace}:batches")]
    assert any(e.get("joined") in host_batches and e["batch_id"] in late_batches for e in log), (
        "the late jobs joined a running batch"
    )


def test_jobs_submitted_while_a_batch_runs_join_it_at_a_step_boundary(tmp_path, redis, redis_url, tiny_model):  # type: ignore[no-untyped-def]
    from harness import harness

    # the batch engine's joins (a one-stage pipeline's default is the step engine, whose sequences
    # share steps without batches: tests/integration/test_step_engine.py)
    batch = {"CONVEYOR_ENGINE": "batch"}
    with (
        harness(
            tmp_path, redis_url=redis_url, models={"tiny": tiny_model}, default_model="tiny", extra_env=batch
        ) as one,
        one.client() as client,
    ):
        joins_running_batch(client, redis, one.namespace, tiny_model)


def test_tokens_concatenated_equal_final_text_and_indices_have_no_gap(stack):  # type: ignore[no-untyped-def]
    with stack.client() as client:
        job = submit(
            client,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=20,
            temperature=0,
        )
        stream = events(client, job["urls"]["events"])
    assert stream[-1].event == "done"
    final = stream[-1].data
    assert final["status"] == "succeeded"
    toks = tokens(stream)
    assert "".join(e.data["text"] for e in toks) == final["text"]
    assert [e.data["index"] for e in toks] == list(range(len(toks)))
    assert len({e.id for e in stream}) == len(stream), "event ids are unique"
    timings = final["timings"]
    assert (
        timings["created_at"]
        <= timings["scheduled_at"]
        <= timings["first_token_at"]
        <= timings["finished_at"]
    )


def test_sse_resume_with_last_event_id_receives_exactly_the_rest(stack):  # type: ignore[no-untyped-def]
    with stack.client() as client:
        job = submit(client, prompt="Resume me", max_tokens=30, temperature=0, ignore_eos=True)
        first = events(client, job["urls"]["events"], max_tokens=5)
        assert [e.data["index"] for e in first] == [0, 1, 2, 3, 4]
        rest = events(client, job["urls"]["events"], last_event_id=first[-1].id)
        whole = events(client, job["urls"]["events"])
        after_the_end = client.get(job["urls"]["events"], headers={"Last-Event-ID": rest[-1].id})
    assert after_the_end.status_code == 204, "a browser reconnecting after `done` is told to stop"
    assert [e.data["index"] for e in tokens(rest)] == list(range(5, 30))
    assert rest[-1].event == "done"
    assert [e.id for e in first + rest] == [e.id for e in whole], "no gap, no duplicate"
    assert "".join(e.data["text"] for e in tokens(first + rest)) == rest[-1].data["text"]


def test_32_concurrent_jobs_all_succeed_in_multi_job_batches(stack, redis):  # type: ignore[no-untyped-def]
    with stack.client() as client, ThreadPoolExecutor(32) as pool:
        accepted = list(
            pool.map(
                lambda i: submit(client, prompt=f"job number {i}", max_tokens=16, temperature=0.8, seed=i),
                range(32),
            )
        )
        jobs = list(pool.map(lambda a: wait(client, a["id"]), accepted))
    assert [j["status"] for j in jobs] == ["succeeded"] * 32
    assert all(j["usage"]["completion_tokens"] >= 1 for j in jobs)
    sizes = {j["batch"]["id"]: j["batch"]["size"] for j in jobs}
    assert max(sizes.values()) > 1, f"the batcher formed only single-job batches: {sizes}"
    assert len(sizes) < 32
    log = redis.xrange(f"{stack.namespace}:batches")
    assert max(int(fields[b"size"]) for _, fields in log) > 1


def test_same_seed_same_text(stack):  # type: ignore[no-untyped-def]
    with stack.client() as client:
        body = {
            "prompt": "Sample me",
            "max_tokens": 12,
            "temperature": 1.0,
            "top_p": 0.9,
            "top_k": 50,
            "ignore_eos": True,
        }
        a = wait(client, submit(client, seed=7, **body)["id"])
        b = wait(client, submit(client, seed=7, **body)["id"])
    assert a["status"] == b["status"] == "succeeded"
    assert a["text"] == b["text"]


def test_stop_string_ends_the_job_and_is_not_in_the_text(stack):  # type: ignore[no-untyped-def]
    with stack.client() as client:
        plain = wait(
            client, submit(client, prompt="Stop test", max_tokens=30, temperature=0, ignore_eos=True)["id"]
        )
        text = plain["text"]
        stop = next(text[i : i + 2] for i in range(3, len(text) - 2) if "\ufffd" not in text[i : i + 2])
        job = submit(client, prompt="Stop test", max_tokens=30, temperature=0, ignore_eos=True, stop=[stop])
        stream = events(client, job["urls"]["events"])
    final = stream[-1].data
    assert final["finish_reason"] == "stop"
    assert final["text"] == text[: text.index(stop)]
    assert "".join(e.data["text"] for e in tokens(stream)) == final["text"]


def test_max_tokens_ends_with_length(stack):  # type: ignore[no-untyped-def]
    with stack.client() as client:
        job = wait(client, submit(client, prompt="Count", max_tokens=7, temperature=0, ignore_eos=True)["id"])
    assert job["finish_reason"] == "length"
    assert job["usage"]["completion_tokens"] == 7


def test_inference_endpoint_returns_the_finished_job_or_streams_it(stack):  # type: ignore[no-untyped-def]
    body = {"prompt": "Synchronous", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with stack.client() as client:
        answer = client.post("/v1/inference", json=body)
        assert answer.status_code == 200, answer.text
        job = answer.json()
        stream = events(client, "/v1/inference", method="POST", json_body={**body, "stream": True})
    assert job["status"] == "succeeded" and job["usage"]["completion_tokens"] == 8
    assert stream[-1].event == "done"
    assert "".join(e.data["text"] for e in tokens(stream)) == stream[-1].data["text"] == job["text"]


@pytest.mark.parametrize(
    ("stages", "claim_check_bytes", "engine"),
    [(2, None, "step"), (3, None, "step"), (2, 1, "step"), (2, None, "batch"), (3, 1, "batch")],
    ids=["2-stages", "3-stages", "2-stages-claim-check", "2-stages-batch-engine", "3-stages-batch-engine"],
)
def test_partitioned_pipeline_hands_hidden_states_on_and_matches_generate(  # type: ignore[no-untyped-def]
    tmp_path, redis_url, tiny_model, stages, claim_check_bytes, engine, monkeypatch
):
    from harness import start_harness

    from app.workers import main

    if claim_check_bytes is not None:  # every hidden state by claim check
        monkeypatch.setattr(main, "CLAIM_CHECK_BYTES", claim_check_bytes)

    two = start_harness(
        tmp_path,
        redis_url=redis_url,
        models={"tiny": tiny_model},
        default_model="tiny",
        extra_env={"CONVEYOR_STAGES": str(stages), "CONVEYOR_TORCH_THREADS": "1", "CONVEYOR_ENGINE": engine},
    )
    try:
        with two.client() as client:
            live = client.get("/readyz").json()["checks"]["workers"]["live_per_stage"]
            assert live == {str(k): 1 for k in range(stages)}
            with ThreadPoolExecutor(len(PROMPTS)) as pool:
                results = list(pool.map(lambda p: run_greedy(client, p, 16), PROMPTS))
            joins_running_batch(
                client,
                redis_lib.Redis.from_url(redis_url),
                two.namespace,
                tiny_model,
                hosts=stages,
                batches=engine == "batch",
            )
    finally:
        two.stop()
    for prompt, (job, stream) in zip(PROMPTS, results, strict=True):
        assert job["status"] == "succeeded", job
        assert [e.data["token_id"] for e in tokens(stream)] == reference_tokens(tiny_model, prompt, 16)


def test_a_plan_file_sets_every_stage_layers(tmp_path, redis_url, tiny_model):  # type: ignore[no-untyped-def]
    """`conveyor plan --out` then `conveyor up --plan`: uneven cuts, still token-exact. (The commands
    run in process: their process boundary is not the point.)"""
    import json

    from harness import start_harness
    from typer.testing import CliRunner

    from app.cli import cli

    plan = tmp_path / "plan.json"
    args = ["plan", "--model", str(tiny_model), "--stages", "3", "--dtype", "float32", "--out", str(plan)]
    made = CliRunner().invoke(cli, args)
    assert made.exit_code == 0, made.output
    from app.partitions.planner import Plan

    ranges = Plan.from_json(plan.read_text()).ranges()
    stack = start_harness(
        tmp_path,
        redis_url=redis_url,
        models={"tiny": tiny_model},
        default_model="tiny",
        args=("--plan", str(plan)),
        extra_env={"CONVEYOR_TORCH_THREADS": "1"},
    )
    try:
        with stack.client() as client:
            checks = client.get("/readyz").json()["checks"]
            assert len(checks["workers"]["live_per_stage"]) == 3
            job, stream = run_greedy(client, PROMPTS[1], 12)
        # The workers reported their step latency; `--rebalance` proposes cuts from it.
        env = {
            "REDIS_URL": redis_url,
            "CONVEYOR_NAMESPACE": stack.namespace,
            "CONVEYOR_DEFAULT_MODEL": "tiny",
            "CONVEYOR_MODELS": json.dumps({"tiny": str(tiny_model)}),
        }
        proposal = CliRunner().invoke(
            cli, ["plan", "--model", str(tiny_model), "--rebalance", str(plan)], env=env
        )
    finally:
        stack.stop()
    assert proposal.exit_code == 0, proposal.output
    assert "measured: stage 0" in proposal.output and "stage 2" in proposal.output
    assert [e.data["token_id"] for e in tokens(stream)] == reference_tokens(tiny_model, PROMPTS[1], 12)
    served = {info["stage"]: info for info in checks["stages"].values()}  # what each worker loaded
    for stage, (start, stop) in enumerate(ranges):
        assert (served[stage]["family"], served[stage]["layers"]) == ("llama", [start, stop])
