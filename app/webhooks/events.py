"""Job events -> webhook events: the mapping, token batching and the bodies. Pure (clock passed in).

| job event (its stream)          | webhook event   | `type`          | `data`                          |
|---------------------------------|-----------------|-----------------|---------------------------------|
| the first `token` (index 0)     | `started`       | `job.started`   | id, model, priority, timings    |
| `token`                         | `token` batches | `job.token`     | id, tokens, their text          |
| `done`                          | `completed`     | `job.completed` | the job as polled               |
| `error`, `expired`, `cancelled` | `failed`        | `job.failed`    | the job as polled (status, error) |

A job that ends without a token (expired in the queue, cancelled before it ran) sends no `started`.
Tokens are batched: a batch opens with its first token and is sent `interval_s` later with every
token read by then, or at once before the job's final event; so one job sends at most one `token`
webhook per interval. Every webhook event has a stable id, the same on every retry and after a
dispatcher restart: `msg_{job}_started`, `msg_{job}_completed`, `msg_{job}_failed`,
`msg_{job}_token_{first stream entry}`.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from app.core.jobs import FINAL_EVENT, FINAL_EVENTS, JobStatus

EVENT_TYPES = ("started", "token", "completed", "failed")
DEFAULT_EVENTS = ("started", "completed", "failed")  # `token` is opt-in: it is many requests
FAILED_EVENTS = FINAL_EVENTS - {FINAL_EVENT[JobStatus.SUCCEEDED]}


@dataclass(frozen=True)
class Outgoing:
    """One webhook event, ready to deliver: the same id and body on every attempt."""

    job_id: str
    webhook_id: str
    kind: str  # one of EVENT_TYPES, or `batch.{status}` for a batch's end
    body: str  # JSON; what is signed and sent

    def message(self, url: str, tenant: str | None) -> dict[str, Any]:
        """The delivery task's argument."""
        return {
            "job_id": self.job_id,
            "webhook_id": self.webhook_id,
            "type": self.kind,
            "url": url,
            "tenant": tenant,
            "body": self.body,
        }


def webhook_id(job_id: str, kind: str, entry_id: str | None = None) -> str:
    return f"msg_{job_id}_{kind}" + (f"_{entry_id}" if entry_id else "")


def entry_time(entry_id: str) -> str:
    """The ISO 8601 UTC time of a stream entry (its id's milliseconds): the event's time, stable."""
    millis = int(entry_id.split("-", 1)[0])
    return dt.datetime.fromtimestamp(millis / 1000, tz=dt.UTC).isoformat(timespec="milliseconds")


def body(kind: str, at: str, data: Mapping[str, Any]) -> str:
    """The Standard Webhooks envelope: `{"type", "timestamp", "data"}`."""
    envelope = {"type": f"job.{kind}", "timestamp": at, "data": data}
    return json.dumps(envelope, separators=(",", ":"), ensure_ascii=False)


BATCH_ENDS = ("completed", "failed", "cancelled", "expired")  # a batch's final statuses: `batch.{status}`


def batch_end_event(batch: Mapping[str, Any], *, at: float) -> Outgoing:
    """The one event of an ended batch (OpenAI's `batch.completed` ... `batch.expired`), with the batch
    object as polled for `data`; its id is the batch's and its end's, the same on every retry."""
    status = str(batch["status"])
    if status not in BATCH_ENDS:
        raise ValueError(f"batch {batch['id']} has not ended: {status}")
    when = dt.datetime.fromtimestamp(at, tz=dt.UTC).isoformat(timespec="milliseconds")
    envelope = {"type": f"batch.{status}", "timestamp": when, "data": dict(batch)}
    text = json.dumps(envelope, separators=(",", ":"), ensure_ascii=False)
    return Outgoing(str(batch["id"]), webhook_id(str(batch["id"]), status), f"batch.{status}", text)


def started_data(job: Mapping[str, Any]) -> dict[str, Any]:
    """What `started` says: who and when, not the text (it is going on)."""
    return {k: job[k] for k in ("id", "model", "priority", "timings") if k in job}


@dataclass
class Batch:
    opened_at: float
    first_entry: str
    resume_after: str | None  # the follower's cursor before this batch: where a restart re-reads
    tokens: list[dict[str, Any]] = field(default_factory=list)


class TokenBatches:
    """Token events held per job until their batch is due (at most one `token` webhook per interval)."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.open: dict[str, Batch] = {}

    def add(
        self, job_id: str, entry_id: str, token: dict[str, Any], *, now: float, cursor: str | None
    ) -> None:
        batch = self.open.get(job_id)
        if batch is None:
            batch = self.open[job_id] = Batch(opened_at=now, first_entry=entry_id, resume_after=cursor)
        batch.tokens.append(token)

    def due(self, now: float) -> list[str]:
        return [job for job, b in self.open.items() if now - b.opened_at >= self.interval_s]

    def next_due_in(self, now: float) -> float | None:
        """Seconds until the earliest open batch is due (None: none is open)."""
        if not self.open:
            return None
        return max(0.0, min(b.opened_at for b in self.open.values()) + self.interval_s - now)

    def take(self, job_id: str) -> Batch | None:
        return self.open.pop(job_id, None)

    def holding(self, job_id: str) -> Batch | None:
        return self.open.get(job_id)


def token_event(job_id: str, batch: Batch) -> Outgoing:
    data = {
        "id": job_id,
        "tokens": batch.tokens,
        "text": "".join(str(t.get("text", "")) for t in batch.tokens),
    }
    return Outgoing(
        job_id,
        webhook_id(job_id, "token", batch.first_entry),
        "token",
        body("token", entry_time(batch.first_entry), data),
    )


def kind_of_final(event: str) -> str:
    return "completed" if event == FINAL_EVENT[JobStatus.SUCCEEDED] else "failed"


def parse_events(value: str | None) -> frozenset[str]:
    """The filter stored on a job record (JSON list); the default when absent."""
    if not value:
        return frozenset(DEFAULT_EVENTS)
    return frozenset(json.loads(value))
