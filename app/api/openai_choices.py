"""Several choices from one OpenAI request: `n` samples of each prompt, and a completions request's
several prompts (strings or token ids). Each choice is a job of its own, made as any job is made
(`JobService.submit`: the tenant's rate limit, quotas and admission count each one); a choice's
`index` is its prompt's place times `n` plus its sample's.

Why jobs, not one prefill forked into `n` samples: a job is the unit everything else holds on to
(its record, its stream, its recovery, its fair share and its quota), and a sequence of the stage
runtime is a job. The siblings share their prompt through each stage's prefix cache when they are
prefilled in different batches; siblings prefilled in the same batch compute it once each. With a
`seed`, choice `j` takes `sibling_seed(seed, j)` (`app.core.sampling`): the same request gives the
same choices, and choice 0 is what the request with n=1 gives.

The answer waits for every job, or streams their chunks as they come, each with its choice's index.
One request's jobs end together: a job that fails, is cancelled or expires, a client that goes away,
or a wait past the sync timeout (`JobService.sync_timeout_s`) cancels the others (a single job at
the sync timeout is left running, to be polled).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from pydantic import BaseModel
from sse_starlette.sse import EventSourceResponse

from app.api import audit
from app.api.chat_schemas import ChatCompletionCreate
from app.api.openai_answers import CompletionUsage
from app.api.openai_replies import Reply
from app.api.openai_schemas import MAX_CHOICES, CompletionCreate, OpenAIRequest
from app.api.routes.inference import wait_unless_gone
from app.api.routes.jobs import sse_data
from app.api.schemas import JobCreate
from app.api.service import JobService, Submitted
from app.api.streams import SSE_PING_S, Slot
from app.api.toolformats import ToolFormat
from app.core import aio
from app.core.errors import RETRY_AFTER_S, ConveyorError, InvalidRequest, JobFailed, Refused, SyncTimeout
from app.core.follow import Event
from app.core.jobrecord import JobRecord
from app.core.jobs import JobStatus
from app.core.sampling import sibling_seed

DONE = "[DONE]"  # the last data line of an OpenAI stream


class JobCancelled(ConveyorError):
    """A synchronous OpenAI request whose job was cancelled (POST /v1/jobs/{id}/cancel) first."""

    code = "cancelled"
    status = 409


class JobExpired(Refused):
    """A synchronous OpenAI request whose job was not started within its timeout_s: the load did
    not let it start in the time the client allowed, as when admission refuses it at once (429,
    with the Retry-After every 429 carries)."""

    code = "expired"
    status = 429


@dataclass(frozen=True)
class Choice:
    index: int
    job: JobCreate
    prompt: str | list[int] | None  # a completion's prompt (what echo repeats); None for a chat


def choices_of(body: OpenAIRequest, tool_format: ToolFormat | None = None) -> list[Choice]:
    """The request's choices in `index` order, each with its job (422 past MAX_CHOICES); a chat's
    tools in `tool_format`, the model's."""
    n, one = body.n or 1, body.model_copy(update={"n": None})
    if isinstance(one, CompletionCreate):
        prompts: list[str | list[int] | None] = list(one.prompts())
    else:
        prompts = [None]
    if len(prompts) * n > MAX_CHOICES:
        raise InvalidRequest(
            f"the request asks for {len(prompts) * n} choices ({len(prompts)} prompts x n={n}), over the "
            f"limit of {MAX_CHOICES}",
            limit=MAX_CHOICES,
        )
    made = []
    for i, prompt in enumerate(prompts):
        if isinstance(one, CompletionCreate) and prompt is not None:
            job = one.job_for(prompt)
        elif isinstance(one, ChatCompletionCreate):
            job = one.to_job(tool_format)
        else:
            job = one.to_job()
        for j in range(n):
            seed = None if job.seed is None else sibling_seed(job.seed, j)
            made.append(Choice(i * n + j, job.model_copy(update={"seed": seed}), prompt))
    return made


async def submit_all(
    jobs: JobService, choices: Sequence[Choice], *, tenant: str, idempotency_key: str | None
) -> list[Submitted]:
    """Each choice's job; one refused cancels those already made. An Idempotency-Key names each
    choice's job as `<key>#<index>` (the key itself for a single choice)."""
    made: list[Submitted] = []
    try:
        for choice in choices:
            key = idempotency_key
            if key is not None and len(choices) > 1:
                key = f"{key}#{choice.index}"
            made.append(await jobs.submit(choice.job, tenant=tenant, idempotency_key=key))
    except Exception:
        for submitted in made:
            jobs.cancel_soon(submitted.record.id, "another choice of its request was refused")
        raise
    return made


async def wait_all(request: Request, jobs: JobService, job_ids: list[str]) -> list[JobRecord] | None:
    """Every job's record once it ends; None when the client went away (which cancels them). Of a
    request of several jobs, the first that ends without succeeding cancels the others at once, as
    the sync timeout does those still running; its error is raised."""
    ended: list[JobRecord] = []  # the first job that ended without succeeding

    def end_others(job_id: str, reason: str) -> None:
        for other in job_ids:
            if other != job_id:
                jobs.cancel_soon(other, reason)

    async def wait(job_id: str) -> JobRecord | None:
        record = await wait_unless_gone(request, jobs, job_id)
        if record is not None and record.status.is_finished and record.status != JobStatus.SUCCEEDED:
            if not ended:
                ended.append(record)
                if len(job_ids) > 1:
                    end_others(job_id, f"another choice of its request ended {record.status}")
        return record

    records = await asyncio.gather(*(wait(j) for j in job_ids))
    if any(r is None for r in records):
        return None
    done = [r for r in records if r is not None]
    for record in done:
        audit.note_job(request, record)
    if ended:
        check_succeeded(ended[0], waited_s=jobs.sync_timeout_s)
    running = [r.id for r in done if not r.status.is_finished]
    if running and len(done) > 1:
        end_others("", f"its request was not answered within {jobs.sync_timeout_s:g} s")
        raise SyncTimeout(
            f"jobs {running} did not finish within {jobs.sync_timeout_s:g} s; the request's "
            f"{len(done)} jobs were cancelled",
            job_id=running[0],
        )
    for record in done:
        check_succeeded(record, waited_s=jobs.sync_timeout_s)
    return done


def check_succeeded(record: JobRecord, *, waited_s: float) -> None:
    """Raise the error of a job that did not succeed; one not finished was waited on `waited_s`."""
    job_id, status = record.id, record.status
    if not status.is_finished:
        raise SyncTimeout(
            f"job {job_id} did not finish within {waited_s:g} s; poll /v1/jobs/{job_id}",
            job_id=job_id,
        )
    if status == JobStatus.SUCCEEDED:
        return
    error = record.error or {}
    message = f"job {job_id} ended {status}: {error.get('message', 'no reason recorded')}"
    if status == JobStatus.CANCELLED:
        raise JobCancelled(message, job_id=job_id)
    if status == JobStatus.EXPIRED:
        raise JobExpired(message, retry_after_s=RETRY_AFTER_S, job_id=job_id)
    raise JobFailed(message, job_id=job_id, reason=error.get("code"))


async def events_of(jobs: JobService, job_id: str) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """A job's token events' data in order, and its `prompt` event's (echo's prompt logprobs)."""
    entries = await jobs.redis.xrange(jobs.keys.events(job_id), "-", "+")
    tokens, prompt = [], None
    for _, fields in entries:
        if fields[b"event"] == b"token":
            tokens.append(json.loads(fields[b"data"]))
        elif fields[b"event"] == b"prompt" and prompt is None:
            prompt = json.loads(fields[b"data"])
    return sorted(tokens, key=lambda t: int(t["index"])), prompt


def usage(replies: Sequence[Reply], completion_tokens: Sequence[int], n: int) -> CompletionUsage:
    """A request's usage: each prompt counted once (as OpenAI counts n choices of one prompt), every
    choice's completion tokens."""
    prompt = sum(r.prompt_tokens for r in replies if r.index % n == 0)
    completion = sum(completion_tokens)
    total = prompt + completion
    return CompletionUsage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=total)


def merged(
    answers: Sequence[BaseModel], replies: Sequence[Reply], records: Sequence[JobRecord], n: int
) -> BaseModel:
    """One answer holding every choice's, its usage summed."""
    if len(answers) == 1:
        return answers[0]
    choices = [c for a in answers for c in a.choices]  # type: ignore[attr-defined]
    counts = [r.completion_tokens or 0 for r in records]
    return answers[0].model_copy(update={"choices": choices, "usage": usage(replies, counts, n)})


def stream(
    jobs: JobService,
    choices: Sequence[tuple[str, Reply]],
    *,
    n: int,
    include_usage: bool,
    continuous_usage: bool,
    notes: dict[str, Any],
    slot: Slot,
) -> EventSourceResponse:
    """OpenAI's stream over the choices' jobs (job id, reply): `data: <chunk>` lines, each choice's
    by its index as its tokens come, then `data: [DONE]`. A job that ends without a completion
    (failed, cancelled, expired) sends `data: {"error": ...}` and ends the others before `[DONE]`.
    With `continuous_usage` (vLLM's `continuous_usage_stats`) every chunk carries the usage so far."""
    replies = [reply for _, reply in choices]
    counts = [0] * len(choices)

    def so_far() -> CompletionUsage | None:
        return usage(replies, counts, n) if continuous_usage else None

    def data(chunk: BaseModel | dict[str, Any]) -> dict[str, str]:
        if isinstance(chunk, BaseModel):
            return {"data": sse_data(chunk.model_dump_json())}
        return {"data": sse_data(json.dumps(chunk, separators=(",", ":"), ensure_ascii=False))}

    async def follow(k: int, job_id: str, queue: asyncio.Queue[tuple[int, Event | None]]) -> None:
        try:
            async for event in jobs.events(job_id):
                await queue.put((k, event))
        finally:
            await queue.put((k, None))

    async def generate() -> AsyncIterator[dict[str, str]]:
        queue: asyncio.Queue[tuple[int, Event | None]] = asyncio.Queue()
        tasks = [asyncio.ensure_future(follow(k, job_id, queue)) for k, (job_id, _) in enumerate(choices)]
        records: list[JobRecord | None] = [None] * len(choices)
        held: list[list[dict[str, Any]]] = [[] for _ in choices]  # tokens whose text is not out yet
        failed = None
        try:
            for reply in replies:
                if (first := reply.first(so_far())) is not None:
                    yield data(first)
            running = len(choices)
            while running and failed is None:
                k, event = await queue.get()
                reply = replies[k]
                if event is None:  # this job's stream has ended
                    running -= 1
                    record = records[k] or await jobs.get(choices[k][0], tenant=None)
                    audit.note_job(notes, record)
                    if record.status != JobStatus.SUCCEEDED:
                        failed = record
                        continue
                    counts[k] = record.completion_tokens or 0
                    yield data(reply.last(record.finish_reason, so_far(), held[k]))
                elif event.event == "prompt":
                    if (echoed := reply.echoed(event.data, so_far())) is not None:
                        yield data(echoed)
                elif event.event == "token":
                    held[k].append(event.data)
                    if event.data.get("text"):
                        counts[k] = int(event.data["index"]) + 1
                        chunk = reply.delta(event.data["text"], so_far(), held[k])
                        if chunk is not None:  # else the text is held back (a tool call's start)
                            yield data(chunk)
                            held[k] = []
                if event is not None and event.record is not None:
                    records[k] = event.record  # the final event's: the job as it ended
            if failed is not None:
                for job_id, _ in choices:
                    if job_id != failed.id:
                        jobs.cancel_soon(job_id, "another choice of its request ended first")
                yield data(stream_error(failed))
            elif include_usage:
                yield data(replies[0].usage(usage(replies, counts, n)))
            yield {"data": DONE}
        finally:
            for task in tasks:
                await aio.stop(task)
            slot.release()

    async def disconnected(_: object) -> None:
        for job_id, _ in choices:
            jobs.cancel_soon(job_id, "the client disconnected")

    return EventSourceResponse(
        generate(),
        ping=SSE_PING_S,
        sep="\n",  # as OpenAI frames its stream
        client_close_handler_callable=disconnected,
    )


def stream_error(record: JobRecord) -> dict[str, Any]:
    error = record.error or {}
    status = str(record.status)
    return {
        "error": {
            "code": error.get("code") or status,
            "message": f"job {record.id} ended {status}: {error.get('message', 'no reason recorded')}",
            "type": "server_error" if status == JobStatus.FAILED else "invalid_request_error",
            "details": {"job_id": record.id, "status": status},
        }
    }
