"""The seed's synchronous endpoint: submit and wait, or submit and stream."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from sse_starlette.sse import EventSourceResponse

from app.api.deps import get_jobs, get_settings
from app.api.routes.jobs import ERRORS, event_stream
from app.api.schemas import InferenceRequest, JobCreate, JobPublic
from app.api.service import JobService
from app.core.config import Settings
from app.core.errors import SyncTimeout
from app.core.jobs import JobStatus

router = APIRouter(tags=["inference"])


@router.post("/v1/inference", response_model=JobPublic, responses={**ERRORS, 504: ERRORS[404]})
async def inference(
    body: InferenceRequest, jobs: JobService = Depends(get_jobs), settings: Settings = Depends(get_settings)
) -> JobPublic | EventSourceResponse:
    """Run a job to its end and return it; with `stream: true`, answer with its server-sent events."""
    record = await jobs.submit(JobCreate.model_validate(body.model_dump(exclude={"stream"})))
    if body.stream:
        return event_stream(jobs, record["id"], settings, after=None)
    record = await jobs.wait(record["id"], settings.sync_timeout_s)
    if not JobStatus(record["status"]).is_finished:
        raise SyncTimeout(
            f"job {record['id']} did not finish within {settings.sync_timeout_s:g} s; "
            f"poll /v1/jobs/{record['id']}",
            job_id=record["id"],
        )
    return JobPublic.from_record(record)
