"""The load generator: job clients for the naive server and Conveyor, and closed-loop load over HTTP.

A `Job` is one request-response exchange on a shared `httpx.AsyncClient`, timed on the client's clock:
end-to-end latency and time to first token (TTFT). `naive_job` posts to the naive server's /generate
(no streaming: its TTFT is its latency); `conveyor_job` posts /v1/jobs and follows the job's SSE events.
A job never raises: an HTTP error or a wrong answer is a failed `JobResult`. `run_load` drives jobs with
a number of closed-loop clients; `load_client` and the job clients also serve other load shapes.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.prompts import Prompt

JOB_TIMEOUT_S = 600.0


@dataclass
class JobResult:
    prompt: int
    ok: bool
    latency_s: float
    ttft_s: float | None
    tokens: int
    error: str | None = None
    token_ids: list[int] = field(default_factory=list)
    server_ttft_s: float | None = None  # Conveyor: first_token_at - created_at
    # Conveyor: where that time went: in the intake (created -> scheduled), on the way to the stage
    # (scheduled -> started: the broker and the stage's step in progress), the prefill (-> first token)
    phases_s: dict[str, float] = field(default_factory=dict)
    batch_id: str | None = None  # Conveyor: the batch the job ran in
    batch_size: int | None = None
    refused: bool = False  # Conveyor: the submit was answered 429 or 503 (backpressure, not a failure)
    model: str | None = None  # Conveyor: the model that served it (a route's choice, bench/routes.py)


Job = Callable[[httpx.AsyncClient, Prompt], Awaitable[JobResult]]
OnToken = Callable[[float], None]  # called with the client's clock (perf_counter) at each token event
REFUSED = (429, 503)  # admission's answers to overload: the service working, not failing


def checked(job: JobResult, expected: int) -> JobResult:
    """A job that generated other than the tokens asked for did not do the benchmark's work: it fails."""
    if job.ok and job.tokens != expected:
        job.ok, job.error = False, f"generated {job.tokens} tokens, not {expected}"
    return job


def failure(prompt: Prompt, started: float, error: str) -> JobResult:
    return JobResult(prompt.index, False, time.perf_counter() - started, None, 0, error)


# ---------------------------------------------------------------- load


def load_client(base_url: str, concurrency: int, job_timeout_s: float = JOB_TIMEOUT_S) -> httpx.AsyncClient:
    """One client for up to `concurrency` jobs in flight (each may hold two connections: submit, events)."""
    limits = httpx.Limits(max_connections=2 * concurrency + 4, max_keepalive_connections=2 * concurrency)
    timeout = httpx.Timeout(30.0, read=job_timeout_s)
    return httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout)


async def closed_loop(
    client: httpx.AsyncClient, job: Job, prompts: Sequence[Prompt], concurrency: int
) -> tuple[list[JobResult], float]:
    """`concurrency` clients each run one job after another until the prompts are used up.

    Returns the results in prompt order and the wall time from the first submit to the last completion.
    """
    queue = deque(prompts)
    results: list[JobResult] = []

    async def client_loop() -> None:
        while queue:
            results.append(await job(client, queue.popleft()))

    started = time.perf_counter()
    await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    wall = time.perf_counter() - started
    return sorted(results, key=lambda j: j.prompt), wall


async def run_load(
    base_url: str, job: Job, prompts: Sequence[Prompt], concurrency: int, job_timeout_s: float = JOB_TIMEOUT_S
) -> tuple[list[JobResult], float]:
    """`concurrency` closed-loop clients share the prompts; wall time: first submit to last completion."""
    async with load_client(base_url, concurrency, job_timeout_s) as client:
        return await closed_loop(client, job, prompts, concurrency)


# ---------------------------------------------------------------- naive server


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
        data = answer.json()
        ids = [int(t) for t in data["token_ids"]]
        return checked(JobResult(prompt.index, True, latency, latency, len(ids), token_ids=ids), max_tokens)

    return job


# ---------------------------------------------------------------- conveyor


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


def conveyor_job(max_tokens: int, *, priority: str | None = None, on_token: OnToken | None = None) -> Job:
    """POST /v1/jobs (greedy, exactly `max_tokens` tokens), then follow its events to the end.

    `priority` is sent when given (the server's default otherwise); `on_token` sees every token event.
    A submit answered 429 or 503 is a failed result marked `refused`.
    """

    async def job(client: httpx.AsyncClient, prompt: Prompt) -> JobResult:
        body: dict[str, Any] = {
            "messages": prompt.messages,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0,
        }
        if priority is not None:
            body["priority"] = priority
        started = time.perf_counter()
        try:
            answer = await client.post("/v1/jobs", json=body)
            if answer.status_code != 202:
                error = f"POST /v1/jobs: HTTP {answer.status_code}: {answer.text[:200]}"
                result = failure(prompt, started, error)
                result.refused = answer.status_code in REFUSED
                return result
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
    """Read the job's events up to `done` (or `error`): token times on the client, the final record."""
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
    return finished(prompt, started, final, ids, latency, first_token)


def finished(
    prompt: Prompt,
    started: float,
    final: dict[str, Any],
    ids: list[int],
    latency: float,
    first_token: float | None,
) -> JobResult:
    """The result of a job that succeeded, from its final record and the token ids streamed before it."""
    timings, batch = final.get("timings") or {}, final.get("batch") or {}
    server_ttft = (
        timings["first_token_at"] - timings["created_at"]
        if timings.get("first_token_at") and timings.get("created_at")
        else None
    )
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
    return JobResult(
        prompt.index,
        True,
        latency,
        first_token - started if first_token else None,
        tokens,
        token_ids=ids,
        server_ttft_s=server_ttft,
        phases_s=phases,
        batch_id=batch.get("id"),
        batch_size=batch.get("size"),
        model=final.get("model"),
    )
