"""The seed's synchronous endpoint: submit and wait, or submit and stream."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request, Response
from sse_starlette.sse import EventSourceResponse

from app.api import audit
from app.api.auth import current_tenant
from app.api.deps import get_jobs, get_settings
from app.api.routes.jobs import IDEMPOTENCY_KEY, STREAMED, SUBMIT_ERRORS, event_stream, mark_submitted
from app.api.schemas import InferenceRequest, JobCreate
from app.api.service import JobService
from app.core import aio
from app.core.config import Settings
from app.core.errors import SyncTimeout
from app.core.jobrecord import JobRecord
from app.core.jobview import JobPublic

router = APIRouter(tags=["inference"])

DISCONNECT_POLL_S = 0.5  # how often a waiting request checks that its client is still there
CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it, the access log does


@router.post(
    "/v1/inference",
    response_model=JobPublic,
    responses={**SUBMIT_ERRORS, **STREAMED, 504: SUBMIT_ERRORS[404]},
)
async def inference(
    body: InferenceRequest,
    request: Request,
    response: Response,
    jobs: JobService = Depends(get_jobs),
    settings: Settings = Depends(get_settings),
    tenant: str = Depends(current_tenant),
    idempotency_key: str | None = IDEMPOTENCY_KEY,
) -> JobPublic | EventSourceResponse | Response:
    """Run a job to its end and return it; with `stream: true`, answer with its server-sent events.

    A client that disconnects before the end cancels the job."""
    job = JobCreate.model_validate(body.model_dump(exclude={"stream"}))
    slot = jobs.streams.take(tenant) if body.stream else None  # refused before a job is made
    submitted = await jobs.submit(job, tenant=tenant, idempotency_key=idempotency_key)
    job_id = submitted.record.id
    if slot is not None:
        stream = event_stream(
            jobs,
            job_id,
            settings,
            after=None,
            notes=audit.fields(request),
            slot=slot,
            cancel_on_disconnect=True,
        )
        mark_submitted(request, stream, submitted, job)
        return stream
    mark_submitted(request, response, submitted, job)
    record = await wait_unless_gone(request, jobs, job_id)
    if record is None:
        return Response(status_code=CLIENT_CLOSED)
    audit.note_job(request, record)
    if not record.status.is_finished:
        raise SyncTimeout(
            f"job {job_id} did not finish within {jobs.sync_timeout_s:g} s; poll /v1/jobs/{job_id}",
            job_id=job_id,
        )
    return JobPublic.from_record(record)


async def wait_unless_gone(request: Request, jobs: JobService, job_id: str) -> JobRecord | None:
    """The job's record once it ends (or at the sync timeout); None when the client went away first,
    which cancels the job."""
    waiter = asyncio.ensure_future(jobs.wait(job_id, jobs.sync_timeout_s))
    try:
        while True:
            done, _ = await asyncio.wait({waiter}, timeout=DISCONNECT_POLL_S)
            if done:
                return waiter.result()
            if await request.is_disconnected():
                jobs.cancel_soon(job_id, "the client disconnected")
                return None
    finally:
        await aio.stop(waiter)
