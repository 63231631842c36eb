"""A batch beside interactive traffic: does a 1,000-line batch (OpenAI's Batch API on the queue) keep its
answers exact, and leave interactive requests their time to first token?

1. Idle: streamed /v1/completions at `--rate` a second (Poisson, `--seconds`), nothing else running.
2. The same arrivals while a batch of `--lines` greedy completions runs (uploaded, created, polled to
   its end); the interactive ones go on until the batch has ended.
3. The batch's requests sent one by one (16 at a time), their texts compared with its output lines.

Prints TTFT p50/p95 idle and beside the batch (and their ratio), the batch's lines/s, and how many of its
answers equal the one-by-one ones. Conveyor runs in fp32: in bf16 a row's result depends on its batch.

    .venv/bin/python -m bench.batches [--model smollm2|tiny] [--lines 1000] [--max-tokens 16]
                                      [--rate 0.5] [--seconds 60]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.load import completions_job, loadavg, open_runs, poisson_arrivals
from bench.prompts import Prompt, text_prompt
from bench.report import percentile
from bench.systems import chosen_model, conveyor, say

INTERACTIVE_TOKENS = 16


def lines_of(count: int, max_tokens: int, model: str) -> list[dict[str, Any]]:
    return [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": model, "prompt": f"Fact number {i} about the sea:", "max_tokens": max_tokens,
                     "temperature": 0},
        }
        for i in range(count)
    ]  # fmt: skip


def interactive(
    base_url: str, model: str, rate: float, seconds: float, seed: int
) -> list[tuple[float, float]]:
    """(submitted at, TTFT) of streamed completions arriving at `rate` for `seconds` (perf_counter and
    seconds); a failure is an error."""
    offsets = poisson_arrivals(rate, seconds, seed)
    prompts: list[Prompt] = [
        text_prompt(i, f"Question {seed}-{i}: what is a tide?") for i in range(len(offsets))
    ]
    job = completions_job(INTERACTIVE_TOKENS, model=model)
    (run,) = asyncio.run(open_runs(base_url, [("interactive", job, prompts, offsets)], drain_cap_s=120))
    failed = [j.error for j in run.jobs if not j.ok]
    if failed or len(run.jobs) != len(offsets):
        raise RuntimeError(
            f"interactive requests failed: {failed[:3]} ({len(run.jobs)}/{len(offsets)} ended)"
        )
    return [(j.submitted, j.ttft_s) for j in run.jobs if j.ttft_s is not None]


def run_batch(client: httpx.Client, lines: list[dict[str, Any]]) -> tuple[dict[str, Any], float, float]:
    """The batch as it ended, how long it took, and when it ended (perf_counter)."""
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = client.post(
        "/v1/files", files={"file": ("in.jsonl", content)}, data={"purpose": "batch"}
    ).json()
    body = {"input_file_id": uploaded["id"], "endpoint": "/v1/completions", "completion_window": "24h"}
    started = time.perf_counter()
    batch = client.post("/v1/batches", json=body).json()
    while batch["status"] not in ("completed", "failed", "cancelled", "expired"):
        time.sleep(0.5)
        batch = client.get(f"/v1/batches/{batch['id']}").json()
    return batch, time.perf_counter() - started, time.perf_counter()


def one_by_one(base_url: str, lines: list[dict[str, Any]]) -> list[str]:
    async def run() -> list[str]:
        gate = asyncio.Semaphore(16)
        async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:

            async def one(line: dict[str, Any]) -> str:
                async with gate:
                    answer = await client.post("/v1/completions", json=line["body"])
                    answer.raise_for_status()
                    return str(answer.json()["choices"][0]["text"])

            return list(await asyncio.gather(*(one(line) for line in lines)))

    return asyncio.run(run())


def stats(ttfts: list[float]) -> str:
    p50, p95 = percentile(ttfts, 50), percentile(ttfts, 95)
    return f"TTFT p50 {1000 * (p50 or 0):.0f} ms, p95 {1000 * (p95 or 0):.0f} ms over {len(ttfts)} requests"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    parser.add_argument("--lines", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rate", type=float, default=0.5, help="interactive requests a second")
    parser.add_argument(
        "--seconds", type=float, default=60.0, help="the idle phase, and the least beside the batch"
    )
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="bench-batches-"))
    model = chosen_model(args.model, workdir)
    if model is None:
        return 2
    say(f"load average at start {loadavg():.2f}")
    with conveyor("conveyor", workdir, {"CONVEYOR_DTYPE": "float32"}, model=model) as system:
        idle = [t for _, t in interactive(system.base_url, model.name, args.rate, args.seconds, seed=1)]
        say(f"idle: {stats(idle)}")
        lines = lines_of(args.lines, args.max_tokens, model.name)
        with httpx.Client(base_url=system.base_url, timeout=60) as client:
            done: dict[str, Any] = {}

            async def beside() -> list[tuple[float, float]]:
                ttfts: list[tuple[float, float]] = []
                started, seed = time.perf_counter(), 100
                while "batch" not in done or time.perf_counter() - started < args.seconds:
                    seed += 1  # windows of a quarter of --seconds, each with its own arrivals
                    ttfts += await asyncio.to_thread(
                        interactive, system.base_url, model.name, args.rate, args.seconds / 4, seed
                    )
                return ttfts

            async def both() -> list[tuple[float, float]]:
                load = asyncio.create_task(beside())
                done["batch"] = await asyncio.to_thread(run_batch, client, lines)
                return await load

            timed = asyncio.run(both())
            batch, took, ended = done["batch"]
            busy = [t for at, t in timed if at < ended]  # the requests sent while the batch ran
            output = client.get(f"/v1/files/{batch['output_file_id']}/content").text.splitlines()
        answers = {
            (o := json.loads(x))["custom_id"]: o["response"]["body"]["choices"][0]["text"] for x in output
        }
        alone = one_by_one(system.base_url, lines)
    equal = sum(answers.get(line["custom_id"]) == text for line, text in zip(lines, alone, strict=True))
    say(f"beside the batch: {stats(busy)}")
    ratio = (percentile(busy, 95) or 0) / (percentile(idle, 95) or 1)
    print(
        f"model {model.name}, fp32; {args.lines} lines of {args.max_tokens} tokens; interactive {args.rate}/s"
    )
    print(
        f"batch {batch['status']}: {batch['request_counts']}, {took:.1f} s, {args.lines / took:.1f} lines/s"
    )
    print(f"idle:             {stats(idle)}")
    print(f"beside the batch: {stats(busy)}")
    print(f"TTFT p95 beside the batch / idle: {ratio:.2f}x (target <= 1.5x)")
    print(f"batch answers equal to one-by-one: {equal} of {args.lines}")
    print(f"load average at end {loadavg():.2f}")
    return 0 if batch["status"] == "completed" and equal == args.lines else 1


if __name__ == "__main__":
    raise SystemExit(main())
