"""/v1/jobs/{id}/deliveries: every webhook delivery attempt of a job (app/webhooks/delivery.py)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, Field

from app.api import audit
from app.api.auth import current_tenant
from app.api.deps import get_jobs
from app.api.routes.jobs import ERRORS
from app.api.service import JobService
from app.webhooks.delivery import decode_log, disabled_digest

router = APIRouter(prefix="/v1/jobs", tags=["webhooks"])


class DeliveryAttempt(BaseModel):
    webhook_id: str = Field(description="The event's `webhook-id`: the same on each of its attempts.")
    type: str = Field(description="started, token, completed or failed.")
    attempt: int = Field(description="1 for the first try of this event.")
    at: float = Field(description="Unix time the attempt started.")
    url: str
    status_code: int | None = Field(description="The receiver's answer; null when none came.")
    error: str | None = Field(description="Why no answer came (timeout, refused connection, SSRF guard).")
    duration_ms: float
    outcome: str = Field(description="delivered, retrying, gave_up, disabled (a 410) or skipped.")
    retry_in_s: float | None = Field(default=None, description="The delay before the next attempt.")
    next_attempt_at: float | None = None


class DeliveryLog(BaseModel):
    job_id: str
    callback_url: str | None
    endpoint_disabled: bool = Field(description="The URL answered 410 Gone: nothing more is sent to it.")
    deliveries: list[DeliveryAttempt] = Field(description="Oldest first; the newest 256 kept.")


@router.get("/{job_id}/deliveries", response_model=DeliveryLog, responses=ERRORS)
async def job_deliveries(
    job_id: str, request: Request, jobs: JobService = Depends(get_jobs), tenant: str = Depends(current_tenant)
) -> DeliveryLog:
    """The job's webhook delivery attempts: status code or error, duration, the delay before the next."""
    audit.note(request, job_id=job_id)
    record = await jobs.get(job_id, tenant=tenant)  # 404 job_not_found: unknown, expired or not yours
    audit.note_job(request, record)
    raw = await jobs.redis.lrange(jobs.keys.webhook_deliveries(job_id), 0, -1)
    url = record.callback_url or None
    disabled_key = jobs.keys.webhook_disabled(disabled_digest(tenant, url or ""))
    disabled = bool(url) and bool(await jobs.redis.exists(disabled_key))
    return DeliveryLog(
        job_id=job_id,
        callback_url=url,
        endpoint_disabled=disabled,
        deliveries=[DeliveryAttempt(**entry) for entry in decode_log(raw)],
    )
