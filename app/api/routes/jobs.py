"""/v1/jobs: submit, poll and follow generation jobs."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Header, Request, Response
from sse_starlette.sse import EventSourceResponse

from app.api.deps import get_jobs, get_settings
from app.api.schemas import ErrorBody, JobAccepted, JobCreate, JobPublic, JobUrls
from app.api.service import FINAL_EVENTS, JobService, Submitted
from app.core.config import Settings
from app.core.errors import InvalidRequest

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

EVENT_ID = re.compile(r"^\d+-\d+$")
ERRORS: dict[int | str, dict[str, Any]] = {404: {"model": ErrorBody}, 422: {"model": ErrorBody}}
# Refusals at submit: 409 idempotency_conflict; 429 queue_full, deadline_unmeetable; 503 overloaded,
# circuit_open, stage_unavailable, unavailable (each with Retry-After).
SUBMIT_ERRORS: dict[int | str, dict[str, Any]] = {
    **ERRORS,
    **{status: {"model": ErrorBody} for status in (409, 429, 503)},
}
IDEMPOTENCY_KEY = Header(
    default=None,
    alias="Idempotency-Key",
    description="The same key (within its TTL) and body answer the same job, marked Idempotent-Replayed.",
)


def accepted(request: Request, record: dict[str, str]) -> JobAccepted:
    job_id = record["id"]
    return JobAccepted(
        id=job_id,
        status=record["status"],
        urls=JobUrls(
            self=str(request.url_for("get_job", job_id=job_id)),
            events=str(request.url_for("job_events", job_id=job_id)),
        ),
    )


def mark_replayed(response: Response, submitted: Submitted) -> None:
    if submitted.replayed:
        response.headers["Idempotent-Replayed"] = "true"


@router.post("", status_code=202, response_model=JobAccepted, responses=SUBMIT_ERRORS)
async def create_job(
    body: JobCreate,
    request: Request,
    response: Response,
    jobs: JobService = Depends(get_jobs),
    idempotency_key: str | None = IDEMPOTENCY_KEY,
) -> JobAccepted:
    """Queue a generation job. Poll `urls.self` or follow `urls.events`."""
    submitted = await jobs.submit(body, idempotency_key=idempotency_key)
    out = accepted(request, submitted.record)
    response.headers["Location"] = out.urls.self
    mark_replayed(response, submitted)
    return out


@router.get("/{job_id}", response_model=JobPublic, responses=ERRORS)
async def get_job(job_id: str, jobs: JobService = Depends(get_jobs)) -> JobPublic:
    return JobPublic.from_record(await jobs.get(job_id))


@router.post("/{job_id}/cancel", response_model=JobPublic, responses={**ERRORS, 409: {"model": ErrorBody}})
async def cancel_job(job_id: str, jobs: JobService = Depends(get_jobs)) -> JobPublic:
    """Cancel a job that has not ended: it ends `cancelled`, and its event stream with `cancelled`.

    A job that has already ended answers 409 `job_finished` (its status in `details.status`)."""
    return JobPublic.from_record(await jobs.cancel(job_id))


@router.get(
    "/{job_id}/events",
    responses=ERRORS,
    response_description="Server-sent events: `token`, then `done`, `error`, `cancelled` or `expired`.",
)
async def job_events(
    job_id: str,
    jobs: JobService = Depends(get_jobs),
    settings: Settings = Depends(get_settings),
    last_event_id: str | None = Header(default=None),
) -> Response:
    """Token events of a job; reconnect with `Last-Event-ID` to receive exactly the rest.

    A client that reconnects after the final event gets `204 No Content`, which tells a browser's
    EventSource to stop reconnecting.
    """
    after = _checked_event_id(last_event_id)
    if await jobs.is_over(job_id, after):  # also the 404 for an unknown job, before the stream starts
        return Response(status_code=204)
    return event_stream(jobs, job_id, settings, after=after)


def _checked_event_id(value: str | None) -> str | None:
    if value is None or value == "":
        return None
    if not EVENT_ID.match(value):
        raise InvalidRequest(
            "Last-Event-ID must be an event id received from this stream, like '1700000000000-0'"
        )
    return value


def event_stream(
    jobs: JobService,
    job_id: str,
    settings: Settings,
    *,
    after: str | None,
    cancel_on_disconnect: bool = False,
) -> EventSourceResponse:
    """The job's events as SSE; the final event carries the job as polled. With cancel_on_disconnect
    (a client that submitted and streams in one request), a client that goes away cancels the job."""

    async def generate() -> AsyncIterator[dict[str, str]]:
        async for event in jobs.events(job_id, after):
            if event.event in FINAL_EVENTS:
                data = JobPublic.from_record(await jobs.get(job_id)).model_dump_json()
            else:
                data = json.dumps(event.data, separators=(",", ":"), ensure_ascii=False)
            yield {"id": event.id, "event": event.event, "data": data}

    async def disconnected(_: object) -> None:
        jobs.cancel_soon(job_id, "the client disconnected")

    return EventSourceResponse(
        generate(),
        ping=int(settings.sse_ping_s),
        client_close_handler_callable=disconnected if cancel_on_disconnect else None,
    )
