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
from app.api.service import JobService
from app.core.config import Settings
from app.core.errors import InvalidRequest

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

EVENT_ID = re.compile(r"^\d+-\d+$")
ERRORS: dict[int | str, dict[str, Any]] = {404: {"model": ErrorBody}, 422: {"model": ErrorBody}}


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


@router.post("", status_code=202, response_model=JobAccepted, responses=ERRORS)
async def create_job(
    body: JobCreate, request: Request, response: Response, jobs: JobService = Depends(get_jobs)
) -> JobAccepted:
    """Queue a generation job. Poll `urls.self` or follow `urls.events`."""
    out = accepted(request, await jobs.submit(body))
    response.headers["Location"] = out.urls.self
    return out


@router.get("/{job_id}", response_model=JobPublic, responses=ERRORS)
async def get_job(job_id: str, jobs: JobService = Depends(get_jobs)) -> JobPublic:
    return JobPublic.from_record(await jobs.get(job_id))


@router.get(
    "/{job_id}/events",
    responses=ERRORS,
    response_description="Server-sent events: `token`, then `done` or `error`.",
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
    jobs: JobService, job_id: str, settings: Settings, *, after: str | None
) -> EventSourceResponse:
    async def generate() -> AsyncIterator[dict[str, str]]:
        async for event in jobs.events(job_id, after):
            if event.event in ("done", "error"):
                data = JobPublic.from_record(await jobs.get(job_id)).model_dump_json()
            else:
                data = json.dumps(event.data, separators=(",", ":"), ensure_ascii=False)
            yield {"id": event.id, "event": event.event, "data": data}

    return EventSourceResponse(generate(), ping=int(settings.sse_ping_s))
