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
from tiny import make_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/ is not an installed package

from bench.load import JobResult, conveyor_job, sse_events, sse_lines  # noqa: E402
from bench.prompts import SEED, USER_TOKENS, Prompt, chat_ids, make_prompts, spread  # noqa: E402
from bench.report import SystemRun, percentile, ratio, system_table  # noqa: E402
from bench.scheduling_load import (  # noqa: E402
    Timed,
    TokenLog,
    batch_stats,
    class_summary,
    closed_loop_until,
    cycled,
    jobs_cell,
    open_loop,
    poisson_arrivals,
    throughput,
    tokens_between,
    ttft_row,
)
from bench.scheduling_report import ratios, target_rows, throughput_verdict  # noqa: E402

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


def test_ratio_is_none_without_a_positive_denominator():
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(0.0, 2.0) == 0.0
    assert ratio(1.0, 0.0) is None
    assert ratio(1.0, -1.0) is None


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
    assert job.server_ttft_s == 0.25 and (job.batch_id, job.batch_size) == ("b1", 3)
    assert {k: round(v, 3) for k, v in job.phases_s.items()} == {
        "intake": 0.03,
        "handoff": 0.07,
        "prefill": 0.15,
    }
    assert job.ttft_s is not None and 0 <= job.ttft_s <= job.latency_s
    assert run_conveyor_job(8, 4, 4).error == "generated 4 tokens, not 8"
    assert run_conveyor_job(4, 3, 4).error == "3 token events for 4 tokens"


def test_summary_and_table_count_only_successful_jobs():
    jobs = [
        JobResult(0, True, 1.0, 0.1, 64),
        JobResult(1, True, 3.0, 0.3, 64),
        JobResult(2, False, 0.5, None, 0, "HTTP 500"),
    ]
    run = SystemRun("conveyor c2", jobs, wall_s=4.0)
    summary = run.summary()
    assert (summary["succeeded"], summary["failed"], summary["tokens"]) == (2, 1, 128)
    assert summary["tokens_per_s"] == 32.0 and summary["p50_latency_s"] == 2.0
    assert summary["errors"] == ["HTTP 500"]
    assert system_table([run])[-1] == "| conveyor c2 | 2/3 (1 failed) | 32.0 | 2.00 | 2.98 | 200.0 |"


# ---------------------------------------------------------------- the scheduling benchmark


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
    log = TokenLog()
    for t in times:
        log.add(t)
    assert log.between(1.0, 3.0) == 3


def test_cycled_goes_round_the_prompts():
    assert [p.index for p in cycled(PROMPTS[:3], 7)] == [0, 1, 2, 0, 1, 2, 0]
    assert cycled(PROMPTS[:3], 0) == []


def timed_job(cls, submitted, latency, ttft, ok=True, refused=False, tokens=16):
    error = None if ok else ("POST /v1/jobs: HTTP 429" if refused else "job failed")
    return Timed(cls, submitted, JobResult(0, ok, latency, ttft, tokens if ok else 0, error, refused=refused))


def test_class_summary_counts_refused_failed_and_unfinished_apart():
    jobs = [timed_job("high", 0.0, 1.0, 0.1 * (i + 1)) for i in range(10)]
    jobs += [
        timed_job("high", 0.0, 0.01, None, ok=False, refused=True),
        timed_job("high", 0.0, 2.0, None, ok=False),
    ]
    s = class_summary(jobs, submitted=13)
    assert (s["jobs"], s["ok"], s["refused"], s["failed"], s["unfinished"]) == (13, 10, 1, 1, 1)
    assert s["tokens"] == 160 and s["errors"] == ["job failed"]
    assert abs(s["ttft_p50_s"] - 0.55) < 1e-9 and abs(s["ttft_p95_s"] - 0.955) < 1e-9
    assert jobs_cell(s) == "10/13 (1 refused, 1 failed, 1 unfinished)"
    assert class_summary(jobs[:2])["unfinished"] == 0 and jobs_cell(class_summary(jobs[:2])) == "2/2"
    assert ttft_row("x", class_summary(jobs[:2])) == "| x | 2/2 | 150 | 195 | 199 | 1.00 | 1.00 |"


def test_throughput_runs_from_the_first_arrival_to_the_last_end():
    jobs = [
        timed_job("c", 10.0, 2.0, 0.1),
        timed_job("c", 11.0, 9.0, 0.1),
        timed_job("c", 12.0, 99.0, None, ok=False),
    ]
    t = throughput(jobs, start=10.0)
    assert t == {"span_s": 10.0, "jobs_per_s": 0.2, "tokens_per_s": 3.2}
    assert throughput([], start=0.0)["jobs_per_s"] == 0.0


def test_batch_stats_reads_joins_batches_alone_and_stalls_from_the_batch_log():
    def dispatch(batch_id: str, size: int) -> dict[str, str]:
        return {"batch_id": batch_id, "size": str(size), "bucket": "64"}

    log = [
        (1.0, dispatch("host", 4)),
        (2.0, dispatch("a", 1)),
        (2.5, {"batch_id": "a", "size": "1", "joined": "host"}),
        (3.0, dispatch("alone", 9)),
        (13.0, dispatch("b", 2)),
        (13.4, {"batch_id": "b", "size": "2", "joined": "host"}),
        (20.0, dispatch("later", 1)),
    ]
    b = batch_stats(log, 1.5, 15.0)
    assert (b["dispatched"], b["joined"], b["ran_alone"], b["sizes"]) == (3, 2, 1, [1, 9, 2])
    assert b["joins_into_busiest_host"] == 2 and b["longest_gap_s"] == 10.0
    empty = batch_stats(log, 30.0, 40.0)
    assert (empty["dispatched"], empty["longest_gap_s"], empty["joins_into_busiest_host"]) == (0, 10.0, 0)


def test_ratios_and_verdicts_of_the_scheduling_targets():
    results = {
        "priority": {"high_unloaded": {"ttft_p95_s": 0.2}, "high_saturated": {"ttft_p95_s": 0.25}},
        "poisson": {
            "continuous": {"summary": {"ttft_p99_s": 1.0, "jobs_per_s": 0.97}},
            "request": {"summary": {"ttft_p99_s": 4.0, "jobs_per_s": 1.0}},
        },
    }
    r = ratios(results)
    assert r == {
        "high_p95_ttft_saturated_vs_unloaded": 1.25,
        "p99_ttft_continuous_vs_request": 0.25,
        "throughput_continuous_vs_request": 0.97,
    }
    rows = target_rows(r)
    assert rows[2].endswith("| 1.25x | <= 1.5x | met |")
    assert rows[3].endswith("| 0.25x | <= 0.5x | met |")
    assert rows[4].endswith("| 0.97x | >= 1.0x | met (equal within noise) |")
    assert throughput_verdict(0.9) == "missed" and throughput_verdict(1.2) == "met"
    assert ratios({"priority": {"error": "x"}, "poisson": {}}) == dict.fromkeys(r)


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
    async def go() -> tuple[float, list[Timed], list[Timed], list[float], int]:
        second_started = asyncio.Event()

        async def open_job(client: httpx.AsyncClient, prompt: Prompt) -> JobResult:
            began = time.perf_counter()
            if prompt.index == 0:  # still running when the second is submitted, or never ends: open loop
                await asyncio.wait_for(second_started.wait(), 5.0)
            if prompt.index == 1:
                second_started.set()
            return JobResult(prompt.index, True, time.perf_counter() - began, 0.0, 1)

        in_flight, most = 0, 0

        async def closed_job(client: httpx.AsyncClient, prompt: Prompt) -> JobResult:
            nonlocal in_flight, most
            in_flight += 1
            most = max(most, in_flight)
            await asyncio.sleep(0.01)
            in_flight -= 1
            return JobResult(prompt.index, True, 0.01, 0.01, 1)

        client = httpx.AsyncClient()  # never used by the fake jobs
        opened: list[Timed] = []
        start = time.perf_counter()
        await open_loop(client, open_job, PROMPTS[:3], [0.0, 0.01, 0.2], cls="o", start=start, done=opened)
        closed: list[Timed] = []
        submits: list[float] = []
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
                submitted=submits,
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
    assert sorted(t.job.prompt for t in opened) == [0, 1, 2]
    by_prompt = {t.job.prompt: t for t in opened}
    assert by_prompt[1].submitted < by_prompt[0].ended
    assert 0.19 < by_prompt[2].submitted - start < 0.35
    # closed loop: two clients, one job each at a time, every submitted job ended
    assert most == 2
    assert len(closed) == len(submits) >= 4 and {t.cls for t in closed} == {"n"}
    assert sorted(t.job.prompt for t in closed[:4]) == [0, 1, 2, 3]


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
