"""The suite's load: output lengths per prompt, seeded schedules (Poisson, a 10x burst), and the runs.

Every request is a prompt from bench.prompts with its own output length, drawn once from a seed: a
lognormal clipped to `OUTPUT_TOKENS`, so most answers are short and a few run long, as chat answers do.
Every system sees the same prompts, lengths and arrival times. The pure parts (`output_lengths`,
`burst_arrivals`, `unfinished_waits`, `job_figures`) are unit-tested without a server.

The load shapes reuse bench.scheduling_load's `open_loop` and `closed_loop_until`: an open-loop run
submits on schedule whatever is still running and gives the jobs still in flight `drain_cap_s` after
the last arrival, then abandons them (counted as unfinished, with the time they had waited so far).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.load import Job, JobResult, load_client
from bench.prompts import Prompt
from bench.report import percentile
from bench.scheduling_load import Timed, TokenLog, closed_loop_until, open_loop, poisson_arrivals

OUTPUT_TOKENS = (16, 256)  # every job generates between these many tokens
OUTPUT_MEDIAN = 64  # tokens: the lognormal's median
OUTPUT_SIGMA = 0.7  # its shape: about one job in ten asks for more than 150 tokens
BURST_FACTOR = 10.0


def output_lengths(
    count: int,
    seed: int,
    *,
    median: float = OUTPUT_MEDIAN,
    sigma: float = OUTPUT_SIGMA,
    bounds: tuple[int, int] = OUTPUT_TOKENS,
) -> list[int]:
    """`count` output lengths from a lognormal around `median`, clipped to `bounds`; the same seed, the same
    lengths (and a shorter list is a prefix of a longer one)."""
    rng = random.Random(seed)
    low, high = bounds
    return [min(high, max(low, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(count)]


def burst_arrivals(
    rate: float, *, factor: float, before_s: float, burst_s: float, after_s: float, seed: int
) -> list[float]:
    """Poisson arrivals at `rate` for `before_s`, at `factor * rate` for `burst_s`, at `rate` for `after_s`.

    Each segment is its own seeded Poisson stream (exponential gaps are memoryless, so a segment may
    start afresh at its boundary); the offsets count from 0 and are sorted.
    """
    segments = [
        (0.0, before_s, rate),
        (before_s, burst_s, factor * rate),
        (before_s + burst_s, after_s, rate),
    ]
    offsets: list[float] = []
    for k, (start, length, segment_rate) in enumerate(segments):
        offsets += [start + t for t in poisson_arrivals(segment_rate, length, seed + k)]
    return offsets


def sized(make: Callable[[int], Job], lengths: Mapping[int, int]) -> Job:
    """A job client that asks for each prompt's own output length (`lengths` by prompt index)."""

    async def job(client: Any, prompt: Prompt) -> JobResult:
        return await make(lengths[prompt.index])(client, prompt)

    return job


def offered_tokens_per_s(lengths: Sequence[int], window_s: float) -> float:
    """The tokens the arrivals in a window ask for, per second of that window."""
    return sum(lengths) / window_s if window_s > 0 else 0.0


# ---------------------------------------------------------------- runs


@dataclass
class OpenRun:
    """One open-loop run: the schedule, what ended, and the clock marks (perf_counter)."""

    offsets: list[float]
    prompts: list[Prompt]
    done: list[Timed]
    start: float
    end: float  # when the run stopped waiting: the last completion or the drain deadline
    load: tuple[float, float] = (0.0, 0.0)  # the 1-minute load average before and after
    cls: str = ""  # the system or priority class its jobs ran as


async def open_run(
    base_url: str,
    job: Job,
    prompts: Sequence[Prompt],
    offsets: Sequence[float],
    *,
    cls: str,
    drain_cap_s: float,
    clients: int = 512,
) -> OpenRun:
    """Submit prompt i at offset i; wait for the last job, at most `drain_cap_s` after the last arrival."""
    done: list[Timed] = []
    before = os.getloadavg()[0]
    async with load_client(base_url, clients) as client:
        start = time.perf_counter() + 0.2
        arrivals = open_loop(client, job, prompts, offsets, cls=cls, start=start, done=done)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(arrivals, timeout=(offsets[-1] if offsets else 0.0) + 0.2 + drain_cap_s)
        end = time.perf_counter()
    return OpenRun(list(offsets), list(prompts), done, start, end, (before, os.getloadavg()[0]), cls)


async def burst_run(
    base_url: str,
    streams: Sequence[tuple[str, Job, Sequence[Prompt], Sequence[float]]],
    *,
    drain_cap_s: float,
) -> dict[str, OpenRun]:
    """Several open-loop streams (class, job, prompts, offsets) on one clock, each drained as `open_run`."""
    done: dict[str, list[Timed]] = {cls: [] for cls, *_ in streams}
    before = os.getloadavg()[0]
    last = max((offsets[-1] for *_, offsets in streams if offsets), default=0.0)
    async with load_client(base_url, 512) as client:
        start = time.perf_counter() + 0.2
        loops = [
            open_loop(client, job, prompts, offsets, cls=cls, start=start, done=done[cls])
            for cls, job, prompts, offsets in streams
        ]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*loops), timeout=last + 0.2 + drain_cap_s)
        end = time.perf_counter()
    load = (before, os.getloadavg()[0])
    return {
        cls: OpenRun(list(offsets), list(prompts), done[cls], start, end, load, cls)
        for cls, _, prompts, offsets in streams
    }


@dataclass
class PeakRun:
    clients: int
    window_s: float
    tokens: int  # token events the clients received within the window
    jobs_ended: int
    failed: int
    load: tuple[float, float] = (0.0, 0.0)
    errors: list[str] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.window_s if self.window_s > 0 else 0.0


async def peak_run(
    base_url: str,
    make: Callable[..., Job],
    prompts: Sequence[Prompt],
    *,
    clients: int,
    max_tokens: int,
    ramp_s: float,
    warm_s: float,
    window_s: float,
) -> PeakRun:
    """`clients` closed-loop clients (started over `ramp_s`); the token rate they receive over `window_s`,
    from `warm_s` after the ramp, is the stack's peak. The wait lets the prefills of the ramp's arrivals
    (all `clients` prompts at once) drain, so the window sees steady state: a job ending, the next one's
    prefill joining. The jobs in flight at the end are abandoned (the stack stops next)."""
    tokens = TokenLog()
    job = make(max_tokens, on_token=tokens.add)
    done: list[Timed] = []
    submitted: list[float] = []
    stop = asyncio.Event()
    async with load_client(base_url, clients) as client:
        loops = asyncio.create_task(
            closed_loop_until(
                client,
                job,
                prompts,
                clients=clients,
                cls="peak",
                stagger_s=ramp_s,
                stop=stop,
                done=done,
                submitted=submitted,
            )
        )
        await asyncio.sleep(ramp_s + warm_s)
        start, before = time.perf_counter(), os.getloadavg()[0]
        await asyncio.sleep(window_s)
        end = time.perf_counter()
        stop.set()
        loops.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loops
    failed = [t for t in done if not t.job.ok]
    return PeakRun(
        clients,
        end - start,
        tokens.between(start, end),
        len(done),
        len(failed),
        (before, os.getloadavg()[0]),
        sorted({t.job.error for t in failed if t.job.error}),
    )


# ---------------------------------------------------------------- figures


def unfinished_waits(run: OpenRun) -> list[float]:
    """The jobs that never ended: each one's time in the system when the run gave up (a lower bound on
    its latency). Prompt indices identify jobs: a run's prompts are distinct."""
    ended = {t.job.prompt for t in run.done}
    return [
        run.end - (run.start + offset)
        for prompt, offset in zip(run.prompts, run.offsets, strict=True)
        if prompt.index not in ended
    ]


def itl_s(job: JobResult) -> float | None:
    """Mean inter-token latency of a streamed job: (latency - TTFT) / (tokens - 1); None unstreamed."""
    if not job.ok or job.ttft_s is None or job.tokens < 2 or job.ttft_s >= job.latency_s:
        return None
    return (job.latency_s - job.ttft_s) / (job.tokens - 1)


def job_figures(run: OpenRun) -> dict[str, Any]:
    """Counts, throughput (tokens of successful jobs / first arrival to last completion), latency
    percentiles of the jobs that succeeded, and P99 over those plus the unfinished at their waits."""
    ok = [t for t in run.done if t.job.ok]
    refused = sum(1 for t in run.done if t.job.refused)
    waits = unfinished_waits(run)
    latencies = [t.job.latency_s for t in ok]
    first = run.start + min(run.offsets) if run.offsets else run.start
    span = max(t.ended for t in ok) - first if ok else 0.0
    tokens = sum(t.job.tokens for t in ok)
    ttfts = [t.job.ttft_s for t in ok if t.job.ttft_s is not None]
    itls = [v for v in (itl_s(t.job) for t in ok) if v is not None]
    return {
        "jobs": len(run.offsets),
        "ok": len(ok),
        "refused": refused,
        "failed": len(run.done) - len(ok) - refused,
        "unfinished": len(waits),
        "tokens": tokens,
        "span_s": span,
        "tokens_per_s": tokens / span if span > 0 else 0.0,
        "latency_p50_s": percentile(latencies, 50),
        "latency_p99_s": percentile(latencies, 99),
        "latency_p99_all_s": percentile(latencies + waits, 99),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "itl_p50_s": percentile(itls, 50),
        "itl_p99_s": percentile(itls, 99),
        "waited_s": run.end - first,
        "load_average": list(run.load),
        "errors": sorted({t.job.error for t in run.done if t.job.error and not t.job.refused}),
    }


def queue_wait_s(job: JobResult) -> float | None:
    """started_at - created_at: the time a job waited anywhere (intake, broker, the step in progress)
    before its prefill began. None without the job's timings."""
    if "intake" not in job.phases_s or "handoff" not in job.phases_s:
        return None
    return job.phases_s["intake"] + job.phases_s["handoff"]


def queue_waits(run: OpenRun) -> list[tuple[float, float]]:
    """(submit time from the run's start, queue wait) of each job that succeeded."""
    return sorted(
        (t.submitted - run.start, wait)
        for t in run.done
        if t.job.ok and (wait := queue_wait_s(t.job)) is not None
    )


def wait_stats(waits: Sequence[tuple[float, float]], start: float, end: float) -> dict[str, Any]:
    """Median and P95 queue wait of the jobs submitted in [start, end)."""
    inside = [w for at, w in waits if start <= at < end]
    return {"jobs": len(inside), "median_s": percentile(inside, 50), "p95_s": percentile(inside, 95)}


def job_rows(run: OpenRun) -> list[dict[str, Any]]:
    """Every job for the JSON: its class, submit time from the run's start, its figures and status."""
    rows = []
    for t in sorted(run.done, key=lambda t: t.submitted):
        j = t.job
        rows.append(
            {
                "class": t.cls,
                "prompt": j.prompt,
                "submitted_s": round(t.submitted - run.start, 4),
                "status": "succeeded" if j.ok else ("refused" if j.refused else "failed"),
                "tokens": j.tokens,
                "latency_s": j.latency_s,
                "ttft_s": j.ttft_s,
                "itl_s": itl_s(j),
                "queue_wait_s": queue_wait_s(j),
                "error": j.error,
            }
        )
    ended = {t.job.prompt for t in run.done}
    rows += [
        {"class": run.cls, "prompt": p.index, "submitted_s": round(o, 4), "status": "unfinished"}
        for p, o in zip(run.prompts, run.offsets, strict=True)
        if p.index not in ended
    ]
    return rows
