"""Domain errors. Each carries a stable machine-readable `code` and the HTTP status the API maps it to."""

from __future__ import annotations

import math
from typing import Any

# Retry-After of a refusal when nothing better is known (Redis away, no measured completion rate).
RETRY_AFTER_S = 2.0


class ConveyorError(Exception):
    code = "internal_error"
    status = 500
    retry_after_s: float | None = None  # set on refusals a client should retry: the Retry-After header

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def body(self) -> dict[str, Any]:
        error: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.details:
            error["details"] = self.details
        return {"error": error}

    def headers(self) -> dict[str, str]:
        """Response headers the refusal carries: Retry-After when it is worth retrying."""
        if not self.retry_after_s:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}


class InvalidRequest(ConveyorError):
    code = "invalid_request"
    status = 422


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class MaxTokensExceeded(InvalidRequest):
    code = "max_tokens_exceeded"


class ModelNotFound(ConveyorError):
    code = "model_not_found"
    status = 404


class UnsupportedModel(InvalidRequest):
    """A model whose architecture the stage workers cannot run exactly: refused before any weight loads."""

    code = "model_unsupported"


class JobNotFound(ConveyorError):
    code = "job_not_found"
    status = 404


class NotServed(ConveyorError):
    code = "not_served"
    status = 503


class JobFailed(ConveyorError):
    """A synchronous request whose job ended in failure: the workers' error, passed on."""

    code = "worker_error"
    status = 502


class SyncTimeout(ConveyorError):
    code = "timeout"
    status = 504


class IllegalTransition(ConveyorError):
    """A move the lifecycle table does not allow: a bug in the caller, never a user error."""

    code = "illegal_transition"

    def __init__(self, job_id: str, current: str | None, target: str) -> None:
        super().__init__(
            f"job {job_id}: illegal transition {current or '<missing>'} -> {target}",
            job_id=job_id,
            current=current,
            target=str(target),
        )


class JobFinished(ConveyorError):
    """Cancelling a job that has already ended."""

    code = "job_finished"
    status = 409


class IdempotencyConflict(ConveyorError):
    """An Idempotency-Key reused with a different request body."""

    code = "idempotency_conflict"
    status = 409


class Refused(ConveyorError):
    """A job refused at submit because it cannot be served now; retry after `retry_after_s`.

    `details.retry_after_s` repeats the Retry-After header (whole seconds, at least 1).
    """

    def __init__(self, message: str, *, retry_after_s: float, **details: Any) -> None:
        self.retry_after_s = float(max(1, math.ceil(retry_after_s)))
        super().__init__(message, **details, retry_after_s=int(self.retry_after_s))


class QueueFull(Refused):
    code = "queue_full"
    status = 429


class TenantQueueFull(Refused):
    """The tenant already has its share of the job's priority class waiting
    (`AdmissionSettings.tenant_queue_limit`); other tenants are still admitted while the class has room."""

    code = "tenant_queue_full"
    status = 429


class TenantQuotaExceeded(Refused):
    """The tenant's jobs already hold its quota of Redis (`Settings.tenant.retained_bytes`): room comes
    back as its oldest jobs' records expire (`ended_job_ttl_s` after they end)."""

    code = "tenant_quota_exceeded"
    status = 429


class DeadlineUnmeetable(Refused):
    """The predicted queue wait is already longer than the job's timeout_s."""

    code = "deadline_unmeetable"
    status = 429


class Overloaded(Refused):
    code = "overloaded"
    status = 503


class CircuitOpen(Refused):
    code = "circuit_open"
    status = 503


class StageUnavailable(Refused):
    """A stage of the model's pipeline has had no live worker for longer than the grace."""

    code = "stage_unavailable"
    status = 503


class Unavailable(Refused):
    """Redis (the job store and queues) does not answer."""

    code = "unavailable"
    status = 503


class StoreFull(Refused):
    """Redis refused a write: it is at its memory bound (`maxmemory`, policy noeviction). Nothing was
    written; reads go on. It clears as ended jobs expire (`ended_job_ttl_s`)."""

    code = "store_full"
    status = 503


class PriorityNotAllowed(ConveyorError):
    """A job for a priority class its tenant is not entitled to (`Settings.tenant.priorities`)."""

    code = "priority_not_allowed"
    status = 403


class Unauthorized(ConveyorError):
    """No credentials, or credentials that do not verify (API key or JWT). `WWW-Authenticate` says
    what the API takes (RFC 6750); `invalid` marks credentials that were sent and refused."""

    code = "unauthorized"
    status = 401

    def __init__(self, message: str, *, invalid: bool = False, **details: Any) -> None:
        super().__init__(message, **details)
        self.invalid = invalid

    def headers(self) -> dict[str, str]:
        challenge = 'Bearer realm="conveyor"'
        if self.invalid:
            challenge += ', error="invalid_token"'
        return {"WWW-Authenticate": challenge}


class TooManyStreams(Refused):
    """A tenant already following as many job event streams as it may (app/api/streams.py)."""

    code = "too_many_streams"
    status = 429


class RateLimited(Refused):
    """A tenant over its request or token rate (app/core/ratelimit.py); the IETF draft's RateLimit-*
    headers describe the limit that refused (`details.limit` names it: requests or tokens)."""

    code = "rate_limited"
    status = 429

    def __init__(
        self, message: str, *, retry_after_s: float, rate_headers: dict[str, str], **details: Any
    ) -> None:
        super().__init__(message, retry_after_s=retry_after_s, **details)
        self.rate_headers = rate_headers

    def headers(self) -> dict[str, str]:
        return {**super().headers(), **self.rate_headers}


class FileNotFound(ConveyorError):
    """A file id that does not exist, has expired, or is another tenant's."""

    code = "file_not_found"
    status = 404


class BatchNotFound(ConveyorError):
    """A batch id that does not exist, has expired, or is another tenant's."""

    code = "batch_not_found"
    status = 404


class BatchFinished(ConveyorError):
    """A batch that has already ended (or is ending) cannot be cancelled."""

    code = "batch_finished"
    status = 409


class FileQuotaExceeded(ConveyorError):
    """An upload past the tenant's stored-file bytes (8 x `batch_file_max_bytes`): delete files, or
    wait for them to expire."""

    code = "file_quota_exceeded"
    status = 429
