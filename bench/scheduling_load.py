"""The scheduling benchmark's load shapes and figures: seeded Poisson arrivals, open and closed loops
on a shared clock, token logs, and per-class TTFT and throughput summaries.

Every job is a `Timed`: its class, the moment it was submitted on the client's clock (perf_counter)
and its `JobResult`. A job answered 429 or 503 is `refused` (backpressure), counted apart from the
failures. The pure parts (`poisson_arrivals`, `tokens_between`, `class_summary`, `throughput`, the
table rows) are unit-tested without a server.
"""

from __future__ import annotations

import asyncio
import bisect
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.load import Job, JobResult
from bench.prompts import Prompt
from bench.report import fmt, percentile

REFUSED_BACKOFF_S = 1.0  # a closed-loop client answered 429/503 waits this long before its next job


@dataclass(frozen=True)
class Timed:
    cls: str  # a priority class, or a run's name
    submitted: float  # perf_counter at submit
    job: JobResult

    @property
    def ended(self) -> float:
        return self.submitted + self.job.latency_s


@dataclass
class TokenLog:
    """The client's arrival times of token events (perf_counter), in order: throughput over a window."""

    times: list[float] = field(default_factory=list)

    def add(self, at: float) -> None:
        self.times.append(at)

    def between(self, start: float, end: float) -> int:
        return tokens_between(self.times, start, end)


def tokens_between(times: Sequence[float], start: float, end: float) -> int:
    """Token events in [start, end); `times` sorted."""
    return bisect.bisect_left(times, end) - bisect.bisect_left(times, start)


def poisson_arrivals(rate: float, duration_s: float, seed: int) -> list[float]:
    """Arrival offsets (seconds from 0) of a Poisson process of `rate` per second within `duration_s`.

    Exponential gaps drawn from `seed`: the same arguments give the same schedule, so every system
    in a run (and a rerun) sees the same arrivals.
    """
    if rate <= 0 or duration_s <= 0:
        return []
    rng = random.Random(seed)
    offsets, t = [], rng.expovariate(rate)
    while t < duration_s:
        offsets.append(t)
        t += rng.expovariate(rate)
    return offsets


def cycled(prompts: Sequence[Prompt], count: int) -> list[Prompt]:
    """`count` prompts, going round `prompts` as often as needed."""
    return [prompts[i % len(prompts)] for i in range(count)]


# ---------------------------------------------------------------- load shapes


async def timed(cls: str, job: Job, client: httpx.AsyncClient, prompt: Prompt) -> Timed:
    submitted = time.perf_counter()
    return Timed(cls, submitted, await job(client, prompt))


async def open_loop(
    client: httpx.AsyncClient,
    job: Job,
    prompts: Sequence[Prompt],
    offsets: Sequence[float],
    *,
    cls: str,
    start: float,
    done: list[Timed],
) -> None:
    """Submit prompt i at `start + offsets[i]` (perf_counter), whatever is still running: open loop.

    Finished jobs are appended to `done` as they end. Cancelled (say by a drain deadline), it
    abandons the jobs still in flight: `len(offsets) - len(done)` never finished.
    """

    async def one(prompt: Prompt) -> None:
        done.append(await timed(cls, job, client, prompt))

    tasks: list[asyncio.Task[None]] = []
    try:
        for prompt, offset in zip(prompts, offsets, strict=True):
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            tasks.append(asyncio.create_task(one(prompt)))
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()


async def closed_loop_until(
    client: httpx.AsyncClient,
    job: Job,
    prompts: Sequence[Prompt],
    *,
    clients: int,
    cls: str,
    stagger_s: float,
    stop: asyncio.Event,
    done: list[Timed],
    submitted: list[float],
) -> None:
    """`clients` loops, each submitting its next job when the last ends, until `stop` is set.

    Client i starts `i * stagger_s / clients` seconds in, so that jobs do not all run in lockstep.
    Each submit's time goes to `submitted`, each finished job to `done`; once `stop` is set the loops
    end with their jobs in flight (cancel the task to abandon those). A refused job's client backs off.
    """

    async def loop(i: int) -> None:
        await asyncio.sleep(i * stagger_s / clients)
        n = i
        while not stop.is_set():
            submitted.append(time.perf_counter())
            result = await timed(cls, job, client, prompts[n % len(prompts)])
            done.append(result)
            n += clients
            if result.job.refused:
                await asyncio.sleep(REFUSED_BACKOFF_S)

    await asyncio.gather(*(loop(i) for i in range(clients)))


# ---------------------------------------------------------------- figures


def class_summary(jobs: Sequence[Timed], submitted: int | None = None) -> dict[str, Any]:
    """Counts (ok, refused, failed, unfinished) and TTFT / latency percentiles of the jobs that succeeded.

    `jobs` are those that ended; `submitted` (default: as many) counts the ones given up in flight too.
    """
    ok = [t.job for t in jobs if t.job.ok]
    ttfts = [j.ttft_s for j in ok if j.ttft_s is not None]
    server = [j.server_ttft_s for j in ok if j.server_ttft_s is not None]
    latencies = [j.latency_s for j in ok]
    refused = sum(1 for t in jobs if t.job.refused)
    return {
        "jobs": len(jobs) if submitted is None else submitted,
        "ok": len(ok),
        "refused": refused,
        "failed": len(jobs) - len(ok) - refused,
        "unfinished": 0 if submitted is None else submitted - len(jobs),
        "tokens": sum(j.tokens for j in ok),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p95_s": percentile(ttfts, 95),
        "ttft_p99_s": percentile(ttfts, 99),
        "server_ttft_p95_s": percentile(server, 95),
        "phases_p95_s": {
            name: percentile([j.phases_s[name] for j in ok if name in j.phases_s], 95)
            for name in ("intake", "handoff", "prefill")
        },
        "latency_p50_s": percentile(latencies, 50),
        "latency_p99_s": percentile(latencies, 99),
        "errors": sorted({t.job.error for t in jobs if t.job.error and not t.job.refused}),
    }


def throughput(jobs: Sequence[Timed], start: float) -> dict[str, Any]:
    """Jobs/s and tokens/s of the successful jobs from `start` (the first arrival) to the last end."""
    ok = [t for t in jobs if t.job.ok]
    if not ok:
        return {"span_s": 0.0, "jobs_per_s": 0.0, "tokens_per_s": 0.0}
    span = max(t.ended for t in ok) - start
    tokens = sum(t.job.tokens for t in ok)
    return {
        "span_s": span,
        "jobs_per_s": len(ok) / span if span > 0 else 0.0,
        "tokens_per_s": tokens / span if span > 0 else 0.0,
    }


def batch_stats(entries: Sequence[tuple[float, dict[str, str]]], start: float, end: float) -> dict[str, Any]:
    """What the batcher and the workers did in [start, end), from the batch log (time, fields) in order.

    A dispatch entry has a `bucket`; a batch that joined a running one has a second entry with
    `joined` (its host). A dispatched batch with no join entry ran on its own: every batch does with
    request-level batching; with continuous batching, one that found no running batch with room.
    The longest gap counts from `start` to the first dispatch, between dispatches, and from the last
    one to `end`: time in which no new batch was started.
    """
    joined_ids = {f["batch_id"] for _, f in entries if "joined" in f}
    dispatched = [(t, f) for t, f in entries if "bucket" in f and start <= t < end]
    hosts = Counter(f["joined"] for t, f in entries if "joined" in f and start <= t < end)
    times = [start, *(t for t, _ in dispatched), end]
    return {
        "dispatched": len(dispatched),
        "joined": sum(1 for _, f in dispatched if f["batch_id"] in joined_ids),
        "ran_alone": sum(1 for _, f in dispatched if f["batch_id"] not in joined_ids),
        "sizes": [int(f["size"]) for _, f in dispatched],
        "joins_into_busiest_host": max(hosts.values(), default=0),
        "longest_gap_s": max(b - a for a, b in zip(times, times[1:], strict=False)),
    }


def jobs_cell(s: dict[str, Any]) -> str:
    """`ok/submitted`, with the refused, failed and unfinished jobs when there are any."""
    extra = [f"{s[k]} {k}" for k in ("refused", "failed", "unfinished") if s.get(k)]
    return f"{s['ok']}/{s['jobs']}" + (f" ({', '.join(extra)})" if extra else "")


def ttft_row(name: str, s: dict[str, Any]) -> str:
    """| name | jobs | TTFT p50 / p95 / p99 (ms) | latency p50 / p99 (s) |"""
    cells = [
        name,
        jobs_cell(s),
        fmt(s["ttft_p50_s"], 1000, 0),
        fmt(s["ttft_p95_s"], 1000, 0),
        fmt(s["ttft_p99_s"], 1000, 0),
        fmt(s["latency_p50_s"]),
        fmt(s["latency_p99_s"]),
    ]
    return "| " + " | ".join(cells) + " |"


TTFT_HEADER = [
    "| jobs | ok/submitted | TTFT p50 (ms) | TTFT p95 (ms) | TTFT p99 (ms) "
    "| latency p50 (s) | latency p99 (s) |",
    "|---|---:|---:|---:|---:|---:|---:|",
]
