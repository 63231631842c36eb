"""The job as every surface shows it: API answers, the final event's view, webhook bodies.

Built from the job's record (`from_record`); the API's routes, the `follow` loop and the webhook
dispatcher all hand out this one shape, so it lives below all of them.
"""

from __future__ import annotations

import json

from pydantic import BaseModel, Field


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
    def from_record(cls, record: dict[str, str]) -> JobPublic:
        def ts(name: str) -> float | None:
            return float(record[name]) if record.get(name) else None

        return cls(
            id=record["id"],
            status=record["status"],
            model=record["model"],
            route=record.get("route") or None,
            route_reason=record.get("route_reason") or None,
            priority=record.get("priority", "normal"),
            text=record.get("text", ""),
            finish_reason=record.get("finish_reason") or None,
            usage=Usage(
                prompt_tokens=int(record.get("prompt_tokens", 0)),
                completion_tokens=int(record.get("completion_tokens", 0)),
            ),
            timings=Timings(**{name: ts(name) for name in Timings.model_fields}),
            attempts=int(record.get("attempts") or 0),
            batch=BatchInfo(id=record["batch_id"], size=int(record["batch_size"]))
            if record.get("batch_id")
            else None,
            error=ErrorInfo(**json.loads(record["error"])) if record.get("error") else None,
            deadline=ts("deadline"),
        )
