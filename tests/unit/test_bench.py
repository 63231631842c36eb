"""The benchmark's pure parts: the prompt set, percentiles and ratios, the SSE parser, a job client.

Nothing here loads a model or starts a server: the tokenizer is tiny.py's byte-level one (one token a
byte) and the job client talks to an httpx.MockTransport.
"""

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from tiny import make_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/ is not an installed package

from bench.load import (  # noqa: E402
    JobResult,
    Run,
    closed_loop_until,
    completions_job,
    conveyor_job,
    inference_job,
    open_loop,
    poisson_arrivals,
    sse_events,
    sse_lines,
    tokens_between,
)
from bench.prompts import SEED, USER_TOKENS, Prompt, chat_ids, make_prompts, spread  # noqa: E402
from bench.report import (  # noqa: E402
    counts,
    errors,
    fmt,
    jobs_cell,
    percentile,
    ratio,
    summary,
    table,
    target_rows,
    throughput,
)

# bench/'s own tests: `make test-bench`, out of the default gate
pytestmark = pytest.mark.bench

TOKENIZER = make_tokenizer()
PROMPTS = make_prompts(TOKENIZER, 64)


def test_prompt_set_is_reproducible_from_its_seed():
    again = make_prompts(TOKENIZER, 64)
    assert again == PROMPTS
    assert make_prompts(TOKENIZER, 64, seed=SEED + 1) != PROMPTS
    assert make_prompts(TOKENIZER, 16) == PROMPTS[:16]  # a shorter run is a prefix of a longer one


def test_prompt_set_spans_its_length_range():
    low, high = USER_TOKENS
    lengths = [p.user_tokens for p in PROMPTS]
    assert all(low <= n <= high for n in lengths)
    assert min(lengths) < low + (high - low) / 4 and max(lengths) > high - (high - low) / 4
    assert len(set(lengths)) > len(lengths) / 2
    assert [p.index for p in PROMPTS] == list(range(64))
    for p in PROMPTS:
        assert p.user_tokens == len(TOKENIZER(p.messages[0]["content"]).input_ids)
        assert p.ids == chat_ids(TOKENIZER, p.messages)
        text = TOKENIZER.decode(p.ids)
        assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_spread_picks_prompts_over_the_lengths_in_their_order():
    few = spread(PROMPTS, 8)
    assert len(few) == 8
    assert [p.index for p in few] == sorted(p.index for p in few)
    ordered = sorted(len(p.ids) for p in PROMPTS)
    lengths = sorted(len(p.ids) for p in few)
    assert lengths[0] <= ordered[len(ordered) // 8] and lengths[-1] >= ordered[-len(ordered) // 8]


def test_percentile_interpolates_between_closest_ranks():
    assert percentile([], 50) is None
    assert percentile([5.0], 99) == 5.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([4.0, 1.0, 3.0, 2.0], 0) == 1.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 100) == 4.0
    assert percentile([float(i) for i in range(101)], 99) == 99.0
    assert percentile([0.0, 10.0], 99) == 9.9


def test_ratio_is_none_without_a_positive_denominator_or_without_a_figure():
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(0.0, 2.0) == 0.0
    assert ratio(1.0, 0.0) is None
    assert ratio(1.0, -1.0) is None
    assert ratio(None, 2.0) is None and ratio(1.0, None) is None  # a figure not measured


async def lines_of(items: list[str]) -> AsyncIterator[str]:
    for item in items:
        yield item


def events(lines: list[str]) -> list[tuple[str, str]]:
    async def collect() -> list[tuple[str, str]]:
        return [event async for event in sse_events(lines_of(lines))]

    return asyncio.run(collect())


def test_sse_parser_on_a_sample_stream():
    stream = [
        ": keep-alive",
        "",
        "event: token",
        'data: {"token_id": 7}',
        "",
        "data: first",
        "data:  indented",
        "",
        "event:done",
        "id: 3",
        "retry: 1000",
        "data: {}",
        "",
        "event: token",
        "data: no blank line after it, so never dispatched",
    ]
    assert events(stream) == [("token", '{"token_id": 7}'), ("message", "first\n indented"), ("done", "{}")]
    assert events([]) == []


def conveyor_server(tokens: int, usage: int) -> httpx.MockTransport:
    """A fake Conveyor api: every job streams `tokens` token events and reports `usage` tokens."""
    done = {
        "status": "succeeded",
        "usage": {"completion_tokens": usage},
        "timings": {"created_at": 10.0, "scheduled_at": 10.03, "started_at": 10.1, "first_token_at": 10.25},
        "batch": {"id": "b1", "size": 3},
    }

    def handle(request: httpx.Request) -> httpx.Response:
        if request.method == "POST" and request.url.path == "/v1/jobs":
            assert json.loads(request.content)["ignore_eos"] is True
            return httpx.Response(202, json={"urls": {"events": "/v1/jobs/j1/events"}})
        lines = [f'event: token\ndata: {{"token_id": {t}}}\n\n' for t in range(tokens)]
        lines.append(f"event: done\ndata: {json.dumps(done)}\n\n")
        return httpx.Response(200, text="".join(lines), headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handle)


def run_conveyor_job(max_tokens: int, tokens: int, usage: int) -> JobResult:
    prompt = Prompt(5, [{"role": "user", "content": "hi"}], 2, [1, 2])

    async def go() -> JobResult:
        async with httpx.AsyncClient(
            base_url="http://api", transport=conveyor_server(tokens, usage)
        ) as client:
            return await conveyor_job(max_tokens)(client, prompt)

    return asyncio.run(go())


def test_conveyor_job_reads_tokens_and_the_final_record():
    job = run_conveyor_job(4, 4, 4)
    assert job.ok and job.error is None and job.prompt == 5
    assert job.token_ids == [0, 1, 2, 3] and job.tokens == 4
    assert {k: round(v, 3) for k, v in job.phases_s.items()} == {
        "intake": 0.03,
        "handoff": 0.07,
        "prefill": 0.15,
    }
    assert job.ttft_s is not None and 0 <= job.ttft_s <= job.latency_s
    assert run_conveyor_job(8, 4, 4).error == "generated 4 tokens, not 8"
    assert run_conveyor_job(4, 3, 4).error == "3 token events for 4 tokens"


def test_summary_and_its_row_count_only_successful_jobs():
    jobs = [
        JobResult(0, True, 1.0, 0.1, 64),
        JobResult(1, True, 3.0, 0.3, 64),
        JobResult(2, False, 0.5, None, 0, "HTTP 500"),
    ]
    run = Run("conveyor c2", jobs, wall_s=4.0)
    s = summary(run)
    assert (s["succeeded"], s["failed"], s["tokens"]) == (2, 1, 128)
    assert s["tokens_per_s"] == 32.0 and s["p50_latency_s"] == 2.0
    assert s["errors"] == ["HTTP 500"]
    cells = [
        (run.name, f"{s['succeeded']}/{s['jobs']}", fmt(s["tokens_per_s"], digits=1), fmt(s["p99_latency_s"]))
    ]
    assert table("system | jobs | tokens/s> | p99 (s)>", cells) == [
        "| system | jobs | tokens/s | p99 (s) |",
        "|---|---|---:|---:|",
        "| conveyor c2 | 2/3 | 32.0 | 2.98 |",
    ]


def test_poisson_arrivals_are_seeded_and_have_the_asked_rate():
    offsets = poisson_arrivals(2.0, 1000.0, seed=7)
    assert offsets == poisson_arrivals(2.0, 1000.0, seed=7)
    assert offsets != poisson_arrivals(2.0, 1000.0, seed=8)
    assert offsets == sorted(offsets) and 0 < offsets[0] and offsets[-1] < 1000.0
    assert 1900 < len(offsets) < 2100  # 2000 expected, sd about 45
    gaps = [b - a for a, b in zip(offsets, offsets[1:], strict=False)]
    assert 0.45 < sum(gaps) / len(gaps) < 0.55
    assert poisson_arrivals(2.0, 10.0, seed=7) == [t for t in offsets if t < 10.0]  # a prefix
    assert poisson_arrivals(0.0, 10.0, seed=7) == [] and poisson_arrivals(1.0, 0.0, seed=7) == []


def test_tokens_between_counts_a_half_open_window():
    times = [1.0, 2.0, 2.0, 3.0, 5.0]
    assert tokens_between(times, 2.0, 3.0) == 2
    assert tokens_between(times, 0.0, 10.0) == 5 and tokens_between(times, 3.5, 4.5) == 0
    assert tokens_between(times, 1.0, 3.0) == 3


def timed_job(cls, submitted, latency, ttft, ok=True, refused=False, tokens=16):
    error = None if ok else ("POST /v1/jobs: HTTP 429" if refused else "job failed")
    tokens = tokens if ok else 0
    return JobResult(0, ok, latency, ttft, tokens, error, refused=refused, cls=cls, submitted=submitted)


def test_counts_keep_refused_failed_and_unfinished_apart():
    jobs = [timed_job("high", 0.0, 1.0, 0.1 * (i + 1)) for i in range(10)]
    jobs += [
        timed_job("high", 0.0, 0.01, None, ok=False, refused=True),
        timed_job("high", 0.0, 2.0, None, ok=False),
    ]
    s = counts(jobs, submitted=13)
    assert (s["jobs"], s["ok"], s["refused"], s["failed"], s["unfinished"]) == (13, 10, 1, 1, 1)
    assert s["tokens"] == 160 and errors(jobs) == ["job failed"]
    assert jobs_cell(s) == "10/13 (1 refused, 1 failed, 1 unfinished)"
    assert counts(jobs[:2])["unfinished"] == 0 and jobs_cell(counts(jobs[:2])) == "2/2"


def test_throughput_runs_from_the_first_arrival_to_the_last_end():
    jobs = [
        timed_job("c", 10.0, 2.0, 0.1),
        timed_job("c", 11.0, 9.0, 0.1),
        timed_job("c", 12.0, 99.0, None, ok=False),
    ]
    t = throughput(jobs, start=10.0)
    assert t == {"span_s": 10.0, "jobs_per_s": 0.2, "tokens_per_s": 3.2}
    assert throughput([], start=0.0)["jobs_per_s"] == 0.0


def lines(chunks: list[str]) -> list[str]:
    async def collect() -> list[str]:
        return [line async for line in sse_lines(lines_of(chunks))]

    return asyncio.run(collect())


def test_sse_lines_break_only_at_cr_lf_and_crlf():
    # U+2028 and NEL are text to SSE (httpx's aiter_lines breaks at them); a CRLF over two chunks is one break
    assert lines(['data: {"text":"a\u2028b\x85c"}\r', "\nx\n", "\ny\rz\r\n", "tail"]) == [
        'data: {"text":"a\u2028b\x85c"}',
        "x",
        "",
        "y",
        "z",
    ]
    assert lines(["a\r"]) == ["a"] and lines([]) == []


def test_conveyor_job_sends_priority_counts_tokens_and_marks_refusals():
    seen: list[dict] = []
    token_times: list[float] = []

    def handle(request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            seen.append(json.loads(request.content))
            if len(seen) > 1:
                return httpx.Response(429, json={"error": {"code": "queue_full"}})
        return conveyor_server(3, 3).handler(request)

    prompt = Prompt(1, [{"role": "user", "content": "hi"}], 2, [1, 2])

    async def go() -> list[JobResult]:
        async with httpx.AsyncClient(base_url="http://api", transport=httpx.MockTransport(handle)) as client:
            job = conveyor_job(3, priority="high", on_token=token_times.append)
            return [await job(client, prompt), await job(client, prompt)]

    first, second = asyncio.run(go())
    assert seen[0]["priority"] == "high" and seen[0]["ignore_eos"] is True
    assert first.ok and len(token_times) == 3 and token_times == sorted(token_times)
    assert not second.ok and second.refused and "HTTP 429" in (second.error or "")
    assert not run_conveyor_job(4, 4, 4).refused


def test_open_and_closed_loops_on_a_fake_job():
    async def go() -> tuple[float, list[JobResult], list[JobResult], list[float], int]:
        second_started = asyncio.Event()

        async def open_job(client: httpx.AsyncClient, prompt: Prompt) -> JobResult:
            began = time.perf_counter()
            if prompt.index == 0:  # still running when the second is submitted, or never ends: open loop
                await asyncio.wait_for(second_started.wait(), 5.0)
            if prompt.index == 1:
                second_started.set()
            return JobResult(prompt.index, True, time.perf_counter() - began, 0.0, 1)

        in_flight, most = 0, 0
        submits: list[float] = []

        async def closed_job(client: httpx.AsyncClient, prompt: Prompt) -> JobResult:
            nonlocal in_flight, most
            submits.append(time.perf_counter())
            in_flight += 1
            most = max(most, in_flight)
            await asyncio.sleep(0.01)
            in_flight -= 1
            return JobResult(prompt.index, True, 0.01, 0.01, 1)

        client = httpx.AsyncClient()  # never used by the fake jobs
        opened: list[JobResult] = []
        start = time.perf_counter()
        await open_loop(client, open_job, PROMPTS[:3], [0.0, 0.01, 0.2], cls="o", start=start, done=opened)
        closed: list[JobResult] = []
        stop = asyncio.Event()
        loops = asyncio.create_task(
            closed_loop_until(
                client,
                closed_job,
                PROMPTS[:4],
                clients=2,
                cls="n",
                stagger_s=0.0,
                stop=stop,
                done=closed,
            )
        )
        deadline = time.monotonic() + 5.0
        while len(closed) < 4:  # four jobs ended, then stop
            assert time.monotonic() < deadline, f"only {len(closed)} closed-loop jobs ended in 5 s"
            await asyncio.sleep(0.005)
        stop.set()
        await asyncio.wait_for(loops, 1.0)  # the jobs in flight end, then the loops do
        await client.aclose()
        return start, opened, closed, submits, most

    start, opened, closed, submits, most = asyncio.run(go())
    # open loop: the second job is submitted before the first ends, the third on schedule
    assert sorted(t.prompt for t in opened) == [0, 1, 2]
    by_prompt = {t.prompt: t for t in opened}
    assert by_prompt[1].submitted < by_prompt[0].ended
    assert 0.19 < by_prompt[2].submitted - start < 0.35
    # closed loop: two clients, one job each at a time, every submitted job ended
    assert most == 2
    assert len(closed) == len(submits) >= 4 and {t.cls for t in closed} == {"n"}
    assert sorted(t.prompt for t in closed[:4]) == [0, 1, 2, 3]


def test_the_ray_serve_batches_are_read_from_its_log() -> None:
    """What `@serve.batch` formed, from the replica's lines in the server's log (Ray prefixes them)."""
    from bench.rayserve_app import BATCH_LINE, batch_sizes, describe

    log = "\n".join(
        [
            "ray serve: ready on port 8200",
            f"(ServeReplica:generator:Generator pid=41) {BATCH_LINE} rows=1 longest=8 seconds=0.210",
            f"(ServeReplica:generator:Generator pid=41) {BATCH_LINE} rows=32 longest=64 seconds=3.100",
            f"{BATCH_LINE} rows=7 longest=8 seconds=0.400",
        ]
    )
    assert batch_sizes(log) == [1, 32, 7]
    assert describe(batch_sizes(log)) == "3 batches, mean 13.3, max 32; sizes: 1x1, 7x1, 32x1"
    assert describe([]) == "no batches"


# ---------------------------------------------------------------- one record, one client each


def test_a_closed_loop_client_backs_off_after_any_failed_job_and_may_take_prompts_from_a_function(
    monkeypatch,
):
    """A job that fails at once (not only a refused one) is not resubmitted in a tight loop."""
    import bench.load

    monkeypatch.setattr(bench.load, "BACKOFF_S", 0.2)
    seen: list[int] = []

    async def failing(client: httpx.AsyncClient, prompt: Prompt) -> JobResult:
        seen.append(prompt.index)
        return JobResult(prompt.index, False, 0.0, None, 0, "HTTP 500")

    async def go() -> list[JobResult]:
        done: list[JobResult] = []
        stop = asyncio.Event()
        loops = asyncio.create_task(
            closed_loop_until(
                httpx.AsyncClient(),
                failing,
                lambda n: Prompt(n, [], 0, [], f"prompt {n}"),  # a fresh prompt per job, not a list's round
                clients=2,
                cls="c",
                stagger_s=0.0,
                stop=stop,
                done=done,
            )
        )
        await asyncio.sleep(0.5)
        stop.set()
        await asyncio.wait_for(loops, 1.0)
        return done

    done = asyncio.run(go())
    assert 2 <= len(done) <= 8  # without the back-off: thousands in half a second
    assert sorted(seen)[:4] == [0, 1, 2, 3] and {j.cls for j in done} == {"c"}


def test_completions_job_times_chunks_and_checks_the_token_count():
    """The peers' client: streamed /v1/completions, TTFT at the first chunk with text, the gaps after it."""
    bodies: list[dict] = []

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append(body)
        chunks = [{"choices": [{"text": f"t{i}"}]} for i in range(body["max_tokens"])]
        chunks.append({"choices": [{"text": ""}], "usage": {"completion_tokens": 3}})
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})

    async def go(max_tokens: int) -> JobResult:
        async with httpx.AsyncClient(base_url="http://peer", transport=httpx.MockTransport(handle)) as client:
            extra = {"ignore_eos": None, "generation_config": "{}"}
            job = completions_job(max_tokens, model="m", extra=extra)
            return await job(client, Prompt(3, [], 0, [], "some words"))

    good = asyncio.run(go(3))
    assert good.ok and good.tokens == 3 and good.prompt == 3 and len(good.gaps_s) == 2
    assert good.ttft_s is not None and 0 <= good.ttft_s <= good.latency_s
    assert bodies[0]["prompt"] == "some words" and bodies[0]["model"] == "m" and bodies[0]["stream"] is True
    assert "ignore_eos" not in bodies[0] and bodies[0]["generation_config"] == "{}"  # None drops a field
    assert asyncio.run(go(4)).error == "generated 3 tokens, not 4"  # usage says 3


def test_inference_job_reads_the_finished_job_and_marks_refusals():
    answers = iter(
        [
            httpx.Response(
                200, json={"status": "succeeded", "usage": {"completion_tokens": 5}, "model": "m"}
            ),
            httpx.Response(200, json={"status": "failed", "usage": {"completion_tokens": 0}}),
            httpx.Response(429, json={"error": {"code": "rate_limited"}}),
        ]
    )
    sent: list[dict] = []

    def handle(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/inference" and request.headers["X-API-Key"] == "k"
        sent.append(json.loads(request.content))
        return next(answers)

    async def go() -> list[JobResult]:
        job = inference_job(lambda p: {"prompt": p.text, "seed": p.index}, {"X-API-Key": "k"})
        async with httpx.AsyncClient(base_url="http://api", transport=httpx.MockTransport(handle)) as client:
            return [await job(client, Prompt(i, [], 0, [], f"p{i}")) for i in range(3)]

    ok, failed, refused = asyncio.run(go())
    assert ok.ok and ok.tokens == 5 and sent[0] == {"prompt": "p0", "seed": 0}
    assert not failed.ok and not failed.refused
    assert not refused.ok and refused.refused


def test_target_rows_show_units_scales_and_counts():
    from bench.report import Target

    rows = target_rows(
        [
            Target("overhead", "c1 TTFT - prefill", 30, False, unit=" ms", scale=1000, digits=1),
            Target("lost", "jobs lost", 0, False, unit="", digits=0),
        ],
        {"overhead": 0.019, "lost": 2.0},
    )
    assert rows[2] == "| c1 TTFT - prefill | 19.0 ms | <= 30 ms | met |"
    assert rows[3] == "| jobs lost | 2 | <= 0 | missed |"


def test_each_start_of_a_system_gets_a_log_of_its_own(tmp_path):
    from bench.systems import fresh_log

    first = fresh_log(tmp_path, "host A: api, batcher")
    assert first.name == "host-A-api-batcher.log"
    first.write_text("")
    assert fresh_log(tmp_path, "host A: api, batcher").name == "host-A-api-batcher-2.log"


def test_the_peer_benchmark_sends_no_prompt_twice():
    """The warm-up and every concurrency get prompts of their own: a prefix cache (Conveyor's by
    16-token blocks, vLLM's by 128) must not be handed a prompt it saw at an earlier level."""
    from bench.peers import WARM_UP_PROMPTS, prompt_sets, requests
    from bench.prompts import text_prompt

    prompts = [text_prompt(i, f"prompt {i}") for i in range(WARM_UP_PROMPTS + requests(1) + requests(16))]
    warm, levels = prompt_sets(prompts, [1, 16])
    assert [len(warm), *map(len, levels)] == [4, 8, 64]
    texts = [p.text for p in warm + levels[0] + levels[1]]
    assert len(set(texts)) == len(texts) == len(prompts)
    with pytest.raises(ValueError, match="76 prompts for 332 requests"):
        prompt_sets(prompts, [1, 16, 64])


def test_the_ab_head_is_a_snapshot_of_the_working_tree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bench.ab runs this tree from a worktree of `snapshot()`: a commit holding the working tree as
    it is (a changed file, a new one; not an ignored one), made without touching the index or HEAD."""
    import subprocess

    from bench import ab

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=tmp_path, capture_output=True, text=True, check=True).stdout

    git("init", "-q")
    git("config", "user.email", "t@example.com")
    git("config", "user.name", "t")
    (tmp_path / ".gitignore").write_text("ignored.txt\n")
    (tmp_path / "kept.txt").write_text("committed\n")
    git("add", "-A")
    git("commit", "-qm", "first")
    head = git("rev-parse", "HEAD")
    (tmp_path / "kept.txt").write_text("changed\n")
    (tmp_path / "new.txt").write_text("untracked\n")
    (tmp_path / "ignored.txt").write_text("ignored\n")
    monkeypatch.setattr(ab, "ROOT", tmp_path)

    commit = ab.snapshot()

    assert git("show", f"{commit}:kept.txt") == "changed\n"
    assert git("show", f"{commit}:new.txt") == "untracked\n"
    assert "ignored.txt" not in git("ls-tree", "--name-only", commit).split()
    assert git("rev-parse", f"{commit}^") == head and git("rev-parse", "HEAD") == head
    assert git("status", "--porcelain") == " M kept.txt\n?? new.txt\n"  # the index as it was
