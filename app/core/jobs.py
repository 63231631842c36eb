"""The job lifecycle (docs/architecture.md): one enum, one transition table, the final events.

The moves themselves are applied by `app/core/jobstore.py`, the one module that writes the job
record: each of its scripts checks that the job is in a state the move may leave (the lists are
generated from `TRANSITIONS`) and writes the new status and its timestamp atomically.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from app.core.errors import IllegalTransition


class JobStatus(enum.StrEnum):
    QUEUED = "queued"
    SCHEDULED = "scheduled"
    RUNNING = "running"
    RECOVERING = "recovering"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"

    @property
    def is_finished(self) -> bool:
        return self in TERMINAL


TERMINAL = frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.EXPIRED})
# The states of a job that waits in its class's intake stream to be scheduled: submitted, put back
# after a dispatch the broker refused, or recovered. Admission's tenant share counts these.
WAITING = frozenset({JobStatus.QUEUED, JobStatus.RECOVERING})

S = JobStatus
TRANSITIONS: Mapping[JobStatus, frozenset[JobStatus]] = {
    S.QUEUED: frozenset({S.SCHEDULED, S.CANCELLED, S.EXPIRED, S.FAILED}),
    S.SCHEDULED: frozenset({S.RUNNING, S.QUEUED, S.RECOVERING, S.CANCELLED, S.EXPIRED, S.FAILED}),
    S.RUNNING: frozenset({S.SUCCEEDED, S.FAILED, S.CANCELLED, S.RECOVERING}),
    S.RECOVERING: frozenset({S.SCHEDULED, S.FAILED, S.CANCELLED}),
    S.SUCCEEDED: frozenset(),
    S.FAILED: frozenset(),
    S.CANCELLED: frozenset(),
    S.EXPIRED: frozenset(),
}

# The record field stamped when a job enters a state (the poll view shows them as timings).
TIMESTAMP_FIELD: Mapping[JobStatus, str] = {
    S.QUEUED: "queued_at",
    S.SCHEDULED: "scheduled_at",
    S.RUNNING: "started_at",
    S.RECOVERING: "recovered_at",
    **{s: "finished_at" for s in TERMINAL},
}


# The event that closes a job's stream, per final status: clients, the CLI and the webhook dispatcher
# stop reading at one of these.
FINAL_EVENT: Mapping[JobStatus, str] = {
    S.SUCCEEDED: "done",
    S.FAILED: "error",
    S.CANCELLED: "cancelled",
    S.EXPIRED: "expired",
}
FINAL_EVENTS = frozenset(FINAL_EVENT.values())


def predecessors(target: JobStatus) -> list[str]:
    return [str(src) for src, targets in TRANSITIONS.items() if target in targets]


@dataclass(frozen=True)
class Transition:
    """One requested move of one job, with the extra fields written when it applies."""

    job_id: str
    target: JobStatus
    fields: Mapping[str, Any] = field(default_factory=dict)
    # The move applies only while the record holds these values (e.g. the batch a worker serves).
    when: Mapping[str, str] = field(default_factory=dict)

    def script_move(self, now: float) -> dict[str, Any]:
        """The move as the scripts' `transition` takes it (app/core/jobscripts.py): the target, the
        statuses it may leave, the guard, and the fields it writes (its timestamp first)."""
        writes: dict[str, Any] = {TIMESTAMP_FIELD[self.target]: now, **self.fields}
        return {
            "to": str(self.target),
            "from": predecessors(self.target),
            "guard": dict(self.when),
            "fields": [x for name, value in writes.items() for x in (name, encode_field(value))],
        }


def check_result(transition: Transition, result: list[Any], *, strict: bool) -> bool:
    applied, current = int(result[0]), text_of(result[1])
    if applied:
        return True
    if strict:
        raise IllegalTransition(transition.job_id, current or None, transition.target)
    return False


def encode_field(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool | int | float):
        return repr(value) if isinstance(value, float) else str(int(value))
    return json.dumps(value, separators=(",", ":"))


def text_of(value: Any) -> str:
    """A Redis reply as text: bytes decoded, None as the empty string."""
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else str(value)


def decode_record(raw: Mapping[Any, Any]) -> dict[str, str]:
    return {text_of(k): text_of(v) for k, v in raw.items()}
