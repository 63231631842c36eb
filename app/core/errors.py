"""Domain errors. Each carries a stable machine-readable `code` and the HTTP status the API maps it to."""

from __future__ import annotations

from typing import Any


class ConveyorError(Exception):
    code = "internal_error"
    status = 500

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def body(self) -> dict[str, Any]:
        error: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.details:
            error["details"] = self.details
        return {"error": error}


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
