"""The benchmark's pure parts: the prompt set, percentiles and ratios, the SSE parser, a job client.

Nothing here loads a model or starts a server: the tokenizer is tiny.py's byte-level one (one token a
byte) and the job client talks to an httpx.MockTransport.
"""

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
from tiny import make_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/ is not an installed package

from bench.load import JobResult, conveyor_job, sse_events  # noqa: E402
from bench.prompts import SEED, USER_TOKENS, Prompt, chat_ids, make_prompts, spread  # noqa: E402
from bench.report import SystemRun, percentile, ratio, system_table  # noqa: E402

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
        "timings": {"created_at": 10.0, "first_token_at": 10.25},
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
