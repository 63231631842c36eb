"""/v1/jobs: submit, poll and follow generation jobs."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Header, Request, Response
from sse_starlette.sse import EventSourceResponse

from app.api import audit
from app.api.auth import current_tenant
from app.api.checks import MAX_IDEMPOTENCY_KEY
from app.api.deps import get_jobs, get_settings
from app.api.schemas import ErrorBody, JobAccepted, JobCreate, JobUrls
from app.api.service import JobService, Submitted
from app.api.streams import SSE_PING_S, Slot
from app.core.config import Settings
from app.core.errors import InvalidRequest
from app.core.jobrecord import JobRecord
from app.core.jobview import JobPublic

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

EVENT_ID = re.compile(r"[0-9]{1,20}-[0-9]{1,20}")  # a stream entry id: milliseconds-sequence
MAX_ID_PART = 2**64 - 1  # each part of an entry id is an unsigned 64-bit number in Redis
# Every protected route may answer 401 unauthorized (with WWW-Authenticate) and 413 payload_too_large.
ERRORS: dict[int | str, dict[str, Any]] = {status: {"model": ErrorBody} for status in (401, 404, 413, 422)}
# Routes that read a JSON body: 400 bad_request when it cannot be parsed at all (not UTF-8).
BODY_ERRORS: dict[int | str, dict[str, Any]] = {**ERRORS, 400: {"model": ErrorBody}}
# Refusals at submit: 409 idempotency_conflict; 429 rate_limited, queue_full, tenant_queue_full,
# deadline_unmeetable; 503 overloaded, circuit_open, stage_unavailable, unavailable (each with
# Retry-After).
SUBMIT_ERRORS: dict[int | str, dict[str, Any]] = {
    **BODY_ERRORS,
    **{status: {"model": ErrorBody} for status in (409, 429, 503)},
}
# A submit that asks for `stream: true` is answered with server-sent events instead of the JSON body.
STREAMED: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The JSON body; with `stream: true`, server-sent events.",
        # One server-sent event, as OpenAPI 3.2 describes an event stream's items.
        "content": {
            "text/event-stream": {
                "schema": {
                    "type": "object",
                    "properties": {
                        "event": {"type": "string"},
                        "data": {"type": "string"},
                        "id": {"type": "string"},
                        "retry": {"type": "integer"},
                    },
                }
            }
        },
    }
}
IDEMPOTENCY_KEY = Header(
    default=None,
    alias="Idempotency-Key",
    description="The same key (within its TTL) and body answer the same job, marked Idempotent-Replayed.",
    # JobService's rule (1 to MAX_IDEMPOTENCY_KEY printable characters), declared in the schema and
    # narrowed to what a header carries portably: visible ASCII, inner spaces (HTTP strips outer ones).
    min_length=1,
    max_length=MAX_IDEMPOTENCY_KEY,
    pattern=r"^[!-~]([ -~]*[!-~])?$",
)


def accepted(request: Request, record: JobRecord) -> JobAccepted:
    job_id = record.id
    return JobAccepted(
        id=job_id,
        status=str(record.status),
        model=record.model,
        route=record.route or None,
        urls=JobUrls(
            self=str(request.url_for("get_job", job_id=job_id)),
            events=str(request.url_for("job_events", job_id=job_id)),
        ),
    )


def mark_submitted(request: Request, response: Response, submitted: Submitted, job: JobCreate) -> None:
    """What every submitting route adds to its answer: `Idempotent-Replayed`, the tenant's RateLimit-*
    headers, and the job (and its prompt, written only with audit_prompts) to the audit entry."""
    if submitted.replayed:
        response.headers["Idempotent-Replayed"] = "true"
    if submitted.quota is not None:
        response.headers.update(submitted.quota.headers())
    audit.note_job(request, submitted.record)
    audit.note(request, prompt=prompt_text(job))


def prompt_text(job: JobCreate) -> str:
    if job.messages is not None:
        return json.dumps([m.model_dump() for m in job.messages], ensure_ascii=False)
    return job.prompt or ""


@router.post("", status_code=202, response_model=JobAccepted, responses=SUBMIT_ERRORS)
async def create_job(
    body: JobCreate,
    request: Request,
    response: Response,
    jobs: JobService = Depends(get_jobs),
    tenant: str = Depends(current_tenant),
    idempotency_key: str | None = IDEMPOTENCY_KEY,
) -> JobAccepted:
    """Queue a generation job. Poll `urls.self` or follow `urls.events`."""
    submitted = await jobs.submit(body, tenant=tenant, idempotency_key=idempotency_key)
    out = accepted(request, submitted.record)
    response.headers["Location"] = out.urls.self
    mark_submitted(request, response, submitted, body)
    return out


@router.get("/{job_id}", response_model=JobPublic, responses=ERRORS)
async def get_job(
    job_id: str, request: Request, jobs: JobService = Depends(get_jobs), tenant: str = Depends(current_tenant)
) -> JobPublic:
    """The job as it stands. Another tenant's job is 404 job_not_found, like an unknown one."""
    audit.note(request, job_id=job_id)  # audited even when refused
    record = await jobs.get(job_id, tenant=tenant)
    audit.note_job(request, record)
    return JobPublic.from_record(record)


@router.post("/{job_id}/cancel", response_model=JobPublic, responses={**ERRORS, 409: {"model": ErrorBody}})
async def cancel_job(
    job_id: str, request: Request, jobs: JobService = Depends(get_jobs), tenant: str = Depends(current_tenant)
) -> JobPublic:
    """Cancel a job that has not ended: it ends `cancelled`, and its event stream with `cancelled`.

    A job that has already ended answers 409 `job_finished` (its status in `details.status`)."""
    audit.note(request, job_id=job_id)
    record = await jobs.cancel(job_id, tenant=tenant)
    audit.note_job(request, record)
    return JobPublic.from_record(record)


@router.get(
    "/{job_id}/events",
    responses={**ERRORS, 429: {"model": ErrorBody}},  # too_many_streams
    response_description="Server-sent events: `token`, then `done`, `error`, `cancelled` or `expired`.",
)
async def job_events(
    job_id: str,
    request: Request,
    jobs: JobService = Depends(get_jobs),
    settings: Settings = Depends(get_settings),
    tenant: str = Depends(current_tenant),
    # A string, never null: absent is "" (a header has no null). The pattern is what _checked_event_id
    # accepts; it answers the 422 with its own message.
    last_event_id: str = Header(default="", json_schema_extra={"pattern": r"^(\d+-\d+)?$"}),
) -> Response:
    """Token events of a job; reconnect with `Last-Event-ID` to receive exactly the rest.

    A client that reconnects after the final event gets `204 No Content`, which tells a browser's
    EventSource to stop reconnecting.
    """
    after = checked_event_id(last_event_id, "Last-Event-ID")
    audit.note(request, job_id=job_id)
    # Also the 404 for an unknown job (or another tenant's), before the stream starts.
    if await jobs.is_over(job_id, after, tenant=tenant):
        return Response(status_code=204)
    slot = jobs.streams.take(tenant)
    return event_stream(jobs, job_id, settings, after=after, notes=audit.fields(request), slot=slot)


def checked_event_id(value: str | None, name: str) -> str | None:
    """An event id a client resumes after (`name`: the header or parameter it came in), or None when
    absent. Who calls: the SSE and WebSocket routes, before Redis sees it: anything but two ASCII
    numbers that fit Redis' 64 bits (a trailing newline, other digits, a number past 2^64) is 422."""
    if value is None or value == "":
        return None
    if not EVENT_ID.fullmatch(value) or any(int(part) > MAX_ID_PART for part in value.split("-")):
        raise InvalidRequest(f"{name} must be an event id received from this stream, like '1700000000000-0'")
    return value


# Characters JSON leaves as they are but many line readers (Python's str.splitlines, httpx's
# iter_lines) take for line ends: escaped in event data, an SSE line stays one line for every client.
LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_data(text: str) -> str:
    """A JSON text made safe as one SSE `data:` line (the same JSON value, escaped)."""
    return text.translate(LINE_BREAKS)


def event_stream(
    jobs: JobService,
    job_id: str,
    settings: Settings,
    *,
    after: str | None,
    notes: dict[str, Any],
    slot: Slot,
    cancel_on_disconnect: bool = False,
) -> EventSourceResponse:
    """The job's events as SSE (the caller has checked the job is the tenant's); the final event
    carries the job as polled, and its token counts go to the audit `notes`. With
    cancel_on_disconnect (a client that submitted and streams in one request), a client that goes
    away cancels the job."""

    async def generate() -> AsyncIterator[dict[str, str]]:
        async for event in jobs.events(job_id, after, slot=slot):
            if event.record is not None:  # the final event: the job as it ended
                audit.note_job(notes, event.record)
                data = JobPublic.from_record(event.record).model_dump_json()
            else:
                data = json.dumps(event.data, separators=(",", ":"), ensure_ascii=False)
            yield {"id": event.id, "event": event.event, "data": sse_data(data)}

    async def disconnected(_: object) -> None:
        jobs.cancel_soon(job_id, "the client disconnected")

    return EventSourceResponse(
        generate(),
        ping=SSE_PING_S,
        client_close_handler_callable=disconnected if cancel_on_disconnect else None,
    )
