"""The job as every surface shows it: API answers, the final event's view, webhook bodies.

Built from the job's record (`from_record`); the API's routes, the `follow` loop and the webhook
dispatcher all hand out this one shape, so it lives below all of them.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from app.core.jobrecord import JobRecord


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int


class Timings(BaseModel):
    created_at: float | None = None
    scheduled_at: float | None = None
    started_at: float | None = None
    first_token_at: float | None = None
    recovered_at: float | None = None  # the last time it was rescheduled after a lost worker
    finished_at: float | None = None


class ErrorInfo(BaseModel):
    code: str
    message: str


class BatchInfo(BaseModel):
    id: str
    size: int


class JobPublic(BaseModel):
    id: str
    status: str
    model: str = Field(description="The model that serves it: with a route, the one the route chose.")
    route: str | None = Field(default=None, description="The route the request named (`auto`), if any.")
    route_reason: str | None = Field(
        default=None,
        description="Why the route chose this model: simple, prompt_length, max_tokens, "
        "complexity, fallback_chat, fallback_down, fallback_deadline (docs/models.md#routes).",
    )
    priority: str
    text: str
    finish_reason: str | None
    usage: Usage
    timings: Timings
    batch: BatchInfo | None
    error: ErrorInfo | None
    attempts: int = Field(default=0, description="Times it was recovered after a lost worker.")
    deadline: float | None = Field(default=None, description="Unix time by which it had to start.")

    @classmethod
    def from_record(cls, record: JobRecord) -> JobPublic:
        return cls(
            id=record.id,
            status=str(record.status),
            model=record.model,
            route=record.route or None,
            route_reason=record.route_reason or None,
            priority=record.priority,
            text=record.text or "",
            finish_reason=record.finish_reason or None,
            usage=Usage(
                prompt_tokens=record.prompt_tokens or 0, completion_tokens=record.completion_tokens or 0
            ),
            timings=Timings(**{name: getattr(record, name) for name in Timings.model_fields}),
            attempts=record.attempts or 0,
            batch=BatchInfo(id=record.batch_id, size=record.batch_size or 0) if record.batch_id else None,
            error=ErrorInfo(**record.error) if record.error else None,
            deadline=record.deadline,
        )
