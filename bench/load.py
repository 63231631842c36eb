"""The load: job clients, seeded schedules, every load shape, and the one record of a job and of a run.

A `Job` is one exchange on a shared `httpx.AsyncClient`, timed on the client's clock; it never
raises: an HTTP error or a wrong answer is a failed `JobResult`, a submit answered 429 or 503 one
marked `refused`. The clients: `conveyor_job` (POST /v1/jobs, then its SSE events), `naive_job`
(the naive server's and Ray Serve's /generate: TTFT is the latency), `completions_job` (streamed
/v1/completions, which every peer serves) and `inference_job` (Conveyor's /v1/inference).

The shapes, on perf_counter: `closed_run` (clients run one job after another over a list),
`closed_loop_until` (until an event is set), `open_runs` (open-loop streams on one clock: each
prompt submitted at its offset, whatever runs), `peak_run` (the token rate closed-loop clients
receive over a window). A `Run` holds one system's jobs with the clock marks and, for an
open loop, the schedule (so jobs that never ended can be counted). The schedules
(`poisson_arrivals`, `burst_arrivals`, `output_lengths`) are functions of their seeds. What a run's
figures are is bench/report.py's.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import json
import math
import os
import random
import re
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.prompts import Prompt

JOB_TIMEOUT_S = 600.0
REFUSED = (429, 503)  # admission's answers to overload: the service working, not failing
BACKOFF_S = 1.0  # a closed-loop client whose job was refused or failed waits this long before its next
OUTPUT_TOKENS = (16, 256)  # `output_lengths`: every job generates between these many tokens
OUTPUT_MEDIAN = 64  # tokens: the lognormal's median
OUTPUT_SIGMA = 0.7  # its shape: about one job in ten asks for more than 150 tokens


@dataclass
class JobResult:
    prompt: int
    ok: bool
    latency_s: float
    ttft_s: float | None
    tokens: int
    error: str | None = None
    token_ids: list[int] = field(default_factory=list)
    # Conveyor: where that time went: in the intake (created -> scheduled), on the way to the stage
    # (scheduled -> started: the broker and the stage's step in progress), the prefill (-> first token)
    phases_s: dict[str, float] = field(default_factory=dict)
    refused: bool = False  # the submit was answered 429 or 503 (backpressure, not a failure)
    gaps_s: list[float] = field(default_factory=list)  # streamed completions: between token chunks
    cls: str = ""  # the class (priority, run) a load shape ran it as
    submitted: float = 0.0  # perf_counter at submit, as a load shape saw it

    @property
    def ended(self) -> float:
        return self.submitted + self.latency_s


Job = Callable[[httpx.AsyncClient, Prompt], Awaitable[JobResult]]
OnToken = Callable[[float], None]  # called with the client's clock (perf_counter) at each token event


def checked(job: JobResult, expected: int) -> JobResult:
    """A job that generated other than the tokens asked for did not do the benchmark's work: it fails."""
    if job.ok and job.tokens != expected:
        job.ok, job.error = False, f"generated {job.tokens} tokens, not {expected}"
    return job


def failure(prompt: Prompt, started: float, error: str, refused: bool = False) -> JobResult:
    return JobResult(prompt.index, False, time.perf_counter() - started, None, 0, error, refused=refused)


def naive_job(max_tokens: int) -> Job:
    """POST /generate for exactly `max_tokens` tokens; the answer comes whole, so TTFT is the latency."""

    async def job(client: httpx.AsyncClient, prompt: Prompt) -> JobResult:
        body = {"messages": prompt.messages, "max_tokens": max_tokens, "ignore_eos": True}
        started = time.perf_counter()
        try:
            answer = await client.post("/generate", json=body)
        except httpx.HTTPError as exc:
            return failure(prompt, started, f"{type(exc).__name__}: {exc}")
        latency = time.perf_counter() - started
        if answer.status_code != 200:
            return failure(prompt, started, f"HTTP {answer.status_code}: {answer.text[:200]}")
        ids = [int(t) for t in answer.json()["token_ids"]]
        return checked(JobResult(prompt.index, True, latency, latency, len(ids), token_ids=ids), max_tokens)

    return job


def conveyor_job(max_tokens: int, *, priority: str | None = None, on_token: OnToken | None = None) -> Job:
    """POST /v1/jobs of a chat prompt (greedy, exactly `max_tokens` tokens), then follow its events to
    the end. `priority` is sent when given; `on_token` sees every token event. A submit answered 429
    or 503 is a failed result marked `refused`.
    """

    async def job(client: httpx.AsyncClient, prompt: Prompt) -> JobResult:
        body: dict[str, Any] = {"messages": prompt.messages, "max_tokens": max_tokens, "ignore_eos": True}
        body |= {"temperature": 0} | ({"priority": priority} if priority else {})
        started = time.perf_counter()
        try:
            answer = await client.post("/v1/jobs", json=body)
            if answer.status_code != 202:
                error = f"POST /v1/jobs: HTTP {answer.status_code}: {answer.text[:200]}"
                return failure(prompt, started, error, refused=answer.status_code in REFUSED)
            job = await follow(client, prompt, answer.json()["urls"]["events"], started, on_token)
            return checked(job, max_tokens)
        except httpx.HTTPError as exc:
            return failure(prompt, started, f"{type(exc).__name__}: {exc}")

    return job


async def follow(
    client: httpx.AsyncClient,
    prompt: Prompt,
    events_url: str,
    started: float,
    on_token: OnToken | None = None,
) -> JobResult:
    """Read the job's events up to `done` (or `error`): token times on the client's clock; from the
    final record, the token count and where the time went (intake, handoff, prefill)."""
    first_token: float | None = None
    ids: list[int] = []
    final: dict[str, Any] | None = None
    async with client.stream("GET", events_url) as response:
        if response.status_code != 200:
            return failure(prompt, started, f"GET events: HTTP {response.status_code}")
        async for event, data in sse_events(sse_lines(response.aiter_text())):
            if event == "token":
                now = time.perf_counter()
                first_token = first_token or now
                ids.append(int(json.loads(data)["token_id"]))
                if on_token is not None:
                    on_token(now)
            elif event in ("done", "error"):
                final = json.loads(data)
                break
    latency = time.perf_counter() - started
    if final is None:
        return failure(prompt, started, "event stream ended without done")
    if final.get("status") != "succeeded":
        return failure(prompt, started, f"job {final.get('status')}: {final.get('error')}")
    timings = final.get("timings") or {}
    marks = ("created_at", "scheduled_at", "started_at", "first_token_at")
    phases = (
        {
            name: timings[b] - timings[a]
            for name, a, b in zip(("intake", "handoff", "prefill"), marks, marks[1:], strict=False)
        }
        if all(timings.get(m) for m in marks)
        else {}
    )
    tokens = int(final["usage"]["completion_tokens"])
    if len(ids) != tokens:
        return failure(prompt, started, f"{len(ids)} token events for {tokens} tokens")
    ttft = first_token - started if first_token else None
    return JobResult(prompt.index, True, latency, ttft, tokens, token_ids=ids, phases_s=phases)


def completions_job(max_tokens: int, *, model: str, extra: Mapping[str, object] | None = None) -> Job:
    """A streamed /v1/completions of the prompt's text for exactly `max_tokens` tokens (`ignore_eos`,
    greedy); TTFT is the first chunk with text, `gaps_s` the gaps between such chunks. `extra`: a
    system's own fields (None drops one it refuses)."""

    async def job(client: httpx.AsyncClient, prompt: Prompt) -> JobResult:
        body: dict[str, object] = {
            "model": model,
            "prompt": prompt.text,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            **(extra or {}),
        }
        body = {name: value for name, value in body.items() if value is not None}
        started = time.perf_counter()
        arrivals: list[float] = []
        usage: int | None = None
        for attempt in range(2):
            try:
                async with client.stream("POST", "/v1/completions", json=body) as answer:
                    if answer.status_code != 200:
                        error = f"HTTP {answer.status_code}: {(await answer.aread())[:200]!r}"
                        return failure(prompt, started, error, refused=answer.status_code in REFUSED)
                    async for line in sse_lines(answer.aiter_text()):
                        if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                            continue
                        chunk = json.loads(line[5:])
                        if chunk.get("usage"):
                            usage = chunk["usage"].get("completion_tokens")
                        if any(choice.get("text") for choice in chunk.get("choices", [])):
                            arrivals.append(time.perf_counter())
            except httpx.RemoteProtocolError as exc:  # a kept-alive connection the server had closed
                if attempt == 0 and not arrivals:  # (llama-server: after 5 requests): once more, anew
                    continue
                return failure(prompt, started, f"{type(exc).__name__}: {exc}")
            except httpx.HTTPError as exc:
                return failure(prompt, started, f"{type(exc).__name__}: {exc}")
            break
        if not arrivals:
            return failure(prompt, started, "no chunk with text")
        gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
        tokens = usage if usage is not None else len(arrivals)
        latency = time.perf_counter() - started
        result = JobResult(prompt.index, True, latency, arrivals[0] - started, tokens, gaps_s=gaps)
        return checked(result, max_tokens)

    return job


def inference_job(body: Callable[[Prompt], dict[str, Any]], headers: Mapping[str, str] | None = None) -> Job:
    """POST /v1/inference with `body(prompt)`: the job runs to its end before the answer comes."""

    async def job(client: httpx.AsyncClient, prompt: Prompt) -> JobResult:
        started = time.perf_counter()
        try:
            answer = await client.post("/v1/inference", json=body(prompt), headers=headers)
        except httpx.HTTPError as exc:
            return failure(prompt, started, f"{type(exc).__name__}: {exc}")
        latency = time.perf_counter() - started
        record = answer.json() if answer.status_code == 200 else {}
        if record.get("status") != "succeeded":
            error = f"HTTP {answer.status_code}: {answer.text[:200]}"
            return failure(prompt, started, error, refused=answer.status_code in REFUSED)
        tokens = int((record.get("usage") or {}).get("completion_tokens", 0))
        return JobResult(prompt.index, True, latency, latency, tokens)

    return job


LINE_BREAK = re.compile(r"\r\n|\n|\r")


async def sse_lines(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """The lines of an event stream, broken only where the SSE spec breaks them (CRLF, LF, CR).

    httpx's `aiter_lines` also breaks at U+2028, U+0085 and the other Unicode separators, which a
    token's text may hold unescaped in its JSON: a line cut there is JSON cut in two.
    """
    buffer = ""
    async for chunk in chunks:
        buffer += chunk
        end = len(buffer) - 1 if buffer.endswith("\r") else len(buffer)  # a CR may be half a CRLF
        *lines, rest = LINE_BREAK.split(buffer[:end])
        buffer = rest + buffer[end:]
        for line in lines:
            yield line
    for line in LINE_BREAK.split(buffer)[:-1]:
        yield line


async def sse_events(lines: AsyncIterator[str]) -> AsyncIterator[tuple[str, str]]:
    """(event, data) pairs from the lines of a server-sent event stream; comments and ids are skipped."""
    event = "message"
    data: list[str] = []
    async for line in lines:
        if not line:
            if data:
                yield event, "\n".join(data)
            event, data = "message", []
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))


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


def offered_tokens_per_s(lengths: Sequence[int], window_s: float) -> float:
    """The tokens the arrivals in a window ask for, per second of that window."""
    return sum(lengths) / window_s if window_s > 0 else 0.0


def sized(make: Callable[[int], Job], lengths: Mapping[int, int]) -> Job:
    """A job client that asks for each prompt's own output length (`lengths` by prompt index)."""

    async def job(client: httpx.AsyncClient, prompt: Prompt) -> JobResult:
        return await make(lengths[prompt.index])(client, prompt)

    return job


def tokens_between(times: Sequence[float], start: float, end: float) -> int:
    """Token events in [start, end); `times` sorted."""
    return bisect.bisect_left(times, end) - bisect.bisect_left(times, start)


@dataclass
class Run:
    """One system's jobs under one load: a closed loop over a list, or an open-loop schedule.

    Closed loop: `wall_s` runs from the first submit to the last completion. Open loop: `offsets`
    (from `start`, perf_counter) and `prompts` are the schedule, `end` when the run stopped waiting
    (the last completion or the drain deadline); a prompt of the schedule with no job never ended.
    """

    name: str
    jobs: list[JobResult]
    wall_s: float = 0.0
    load: tuple[float, float] = (0.0, 0.0)  # the machine's 1-minute load average at start and end
    clients: int = 0  # closed loop: how many
    offsets: list[float] = field(default_factory=list)
    prompts: list[Prompt] = field(default_factory=list)
    start: float = 0.0
    end: float = 0.0

    @property
    def ok(self) -> list[JobResult]:
        return [j for j in self.jobs if j.ok]

    def tokens_per_s(self) -> float:
        return sum(j.tokens for j in self.ok) / self.wall_s if self.wall_s > 0 else 0.0


def loadavg() -> float:
    return os.getloadavg()[0]


def load_client(base_url: str, concurrency: int, job_timeout_s: float = JOB_TIMEOUT_S) -> httpx.AsyncClient:
    """One client for up to `concurrency` jobs in flight (each may hold two connections: submit, events)."""
    limits = httpx.Limits(max_connections=2 * concurrency + 4, max_keepalive_connections=2 * concurrency)
    timeout = httpx.Timeout(30.0, read=job_timeout_s)
    return httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout)


async def timed(cls: str, job: Job, client: httpx.AsyncClient, prompt: Prompt) -> JobResult:
    """The job, marked with its class and its submit time."""
    submitted = time.perf_counter()
    result = await job(client, prompt)
    result.cls, result.submitted = cls, submitted
    return result


def closed_run(name: str, base_url: str, job: Job, prompts: Sequence[Prompt], clients: int) -> Run:
    """`clients` closed-loop clients run one job after another until the prompts are used up (in a
    fresh event loop): the jobs in prompt order, the wall time from the first submit to the last
    completion, and the load average."""
    queue, jobs = deque(prompts), []

    async def run() -> float:
        async with load_client(base_url, clients) as client:

            async def loop() -> None:
                while queue:
                    jobs.append(await timed("", job, client, queue.popleft()))

            started = time.perf_counter()
            await asyncio.gather(*(loop() for _ in range(clients)))
            return time.perf_counter() - started

    before = loadavg()
    wall = asyncio.run(run())
    return Run(name, sorted(jobs, key=lambda j: j.prompt), wall, (before, loadavg()), clients=clients)


async def closed_loop_until(
    client: httpx.AsyncClient,
    job: Job,
    prompts: Sequence[Prompt] | Callable[[int], Prompt],
    *,
    clients: int,
    cls: str,
    stagger_s: float,
    stop: asyncio.Event,
    done: list[JobResult],
) -> None:
    """`clients` loops, each submitting its next job when the last ends, until `stop` is set.

    Client i starts `i * stagger_s / clients` seconds in, so that jobs do not all run in lockstep, and
    runs jobs i, i + clients, ...: prompt n is `prompts(n)`, or of a list the n-th going round it.
    Each finished job goes to `done`; once `stop` is set the loops end with their jobs in flight
    (cancel the task to abandon those). A client whose job was refused or failed waits `BACKOFF_S`
    before its next, rather than resubmit at once in a tight loop.
    """
    pick = prompts if callable(prompts) else lambda n: prompts[n % len(prompts)]

    async def loop(i: int) -> None:
        await asyncio.sleep(i * stagger_s / clients)
        n = i
        while not stop.is_set():
            result = await timed(cls, job, client, pick(n))
            done.append(result)
            n += clients
            if not result.ok:
                await asyncio.sleep(BACKOFF_S)

    await asyncio.gather(*(loop(i) for i in range(clients)))


async def open_loop(
    client: httpx.AsyncClient,
    job: Job,
    prompts: Sequence[Prompt],
    offsets: Sequence[float],
    *,
    cls: str,
    start: float,
    done: list[JobResult],
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


Stream = tuple[str, Job, Sequence[Prompt], Sequence[float]]  # class, job client, prompts, offsets


async def open_runs(
    base_url: str, streams: Sequence[Stream], *, drain_cap_s: float, clients: int = 512
) -> list[Run]:
    """Open-loop streams on one clock (a run each, named by its class): every prompt submitted at its
    offset; the jobs still in flight `drain_cap_s` after the last arrival are abandoned."""
    done: dict[str, list[JobResult]] = {cls: [] for cls, *_ in streams}
    before = loadavg()
    last = max((offsets[-1] for *_, offsets in streams if offsets), default=0.0)
    async with load_client(base_url, clients) as client:
        start = time.perf_counter() + 0.2
        loops = [
            open_loop(client, job, prompts, offsets, cls=cls, start=start, done=done[cls])
            for cls, job, prompts, offsets in streams
        ]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*loops), timeout=last + 0.2 + drain_cap_s)
        end = time.perf_counter()
    load = (before, loadavg())
    return [
        Run(cls, done[cls], end - start, load, offsets=list(o), prompts=list(p), start=start, end=end)
        for cls, _, p, o in streams
    ]


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
) -> dict[str, Any]:
    """`clients` closed-loop clients (started over `ramp_s`); the token rate they receive over `window_s`,
    from `warm_s` after the ramp, is the stack's peak. The wait lets the prefills of the ramp's arrivals
    (all `clients` prompts at once) drain, so the window sees steady state: a job ending, the next one's
    prefill joining. The jobs in flight at the end are abandoned (the stack stops next)."""
    tokens: list[float] = []  # the client's clock at each token event, in order
    job = make(max_tokens, on_token=tokens.append)
    done: list[JobResult] = []
    stop = asyncio.Event()
    async with load_client(base_url, clients) as client:
        loops = asyncio.create_task(
            closed_loop_until(
                client, job, prompts, clients=clients, cls="peak", stagger_s=ramp_s, stop=stop, done=done
            )
        )
        await asyncio.sleep(ramp_s + warm_s)
        start, before = time.perf_counter(), loadavg()
        await asyncio.sleep(window_s)
        end = time.perf_counter()
        stop.set()
        loops.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loops
    failed = [j for j in done if not j.ok]
    window, received = end - start, tokens_between(tokens, start, end)
    return {
        "clients": clients,
        "window_s": window,
        "tokens": received,  # token events the clients received within the window
        "jobs_ended": len(done),
        "failed": len(failed),
        "load": (before, loadavg()),
        "errors": sorted({j.error for j in failed if j.error}),
        "tokens_per_s": received / window if window > 0 else 0.0,
    }
