"""Bodies of /v1/files and /v1/batches, in OpenAI's shapes (the official client parses them)."""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from app.core.batchstore import StoredFile

Endpoint = Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]
BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
]


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    expires_at: int | None = None
    filename: str
    purpose: str = Field(
        description="`batch` for an upload, `batch_output` for a batch's output or error file."
    )
    status: Literal["processed"] = "processed"
    status_details: str | None = None

    @classmethod
    def of(cls, stored: StoredFile) -> FileObject:
        return cls(
            id=stored.id,
            bytes=stored.bytes,
            created_at=stored.created_at,
            expires_at=stored.expires_at,
            filename=stored.filename,
            purpose=stored.purpose,
        )


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class BatchCreate(BaseModel):
    model_config = ConfigDict(
        extra="ignore",
        json_schema_extra={
            "examples": [
                {
                    "input_file_id": "file-0123456789abcdef0123456789abcdef",
                    "endpoint": "/v1/chat/completions",
                    "completion_window": "24h",
                }
            ]
        },
    )

    input_file_id: str = Field(max_length=64, description="An uploaded file (purpose `batch`) of yours.")
    endpoint: Endpoint
    completion_window: Literal["24h"] = Field(description="The lines not run within it end `batch_expired`.")
    metadata: dict[str, str] | None = Field(
        default=None, description="Up to 16 pairs, keys up to 64 characters, values up to 512, kept as given."
    )
    # Webhooks (app/webhooks/): one signed POST when the batch ends (an extension of OpenAI's body).
    callback_url: str | None = Field(
        default=None,
        max_length=2048,
        description="http(s) URL that receives one signed event when the batch ends: `batch.completed`, "
        "`batch.failed`, `batch.cancelled` or `batch.expired`, with the batch object as `data`. "
        "Refused (422 callback_url_refused) when it reaches a private, loopback or link-local address.",
    )

    @field_validator("metadata")
    @classmethod
    def _small(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        if metadata is not None and (
            len(metadata) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in metadata.items())
        ):
            raise ValueError("at most 16 pairs, keys up to 64 characters, values up to 512")
        return metadata


class BatchError(BaseModel):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class BatchPublic(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts
    metadata: dict[str, str] | None = None

    @classmethod
    def of(cls, record: dict[str, str]) -> BatchPublic:
        def when(name: str) -> int | None:
            return int(record[name]) if record.get(name) else None

        return cls(
            id=record["id"],
            endpoint=record["endpoint"],
            errors=BatchErrors.model_validate_json(record["errors"]) if record.get("errors") else None,
            input_file_id=record["input_file_id"],
            completion_window=record["completion_window"],
            status=record["status"],  # type: ignore[arg-type]
            output_file_id=record.get("output_file_id"),
            error_file_id=record.get("error_file_id"),
            created_at=int(record["created_at"]),
            in_progress_at=when("in_progress_at"),
            expires_at=when("expires_at"),
            finalizing_at=when("finalizing_at"),
            completed_at=when("completed_at"),
            failed_at=when("failed_at"),
            expired_at=when("expired_at"),
            cancelling_at=when("cancelling_at"),
            cancelled_at=when("cancelled_at"),
            request_counts=RequestCounts(
                total=int(record.get("total", 0)),
                completed=int(record.get("completed", 0)),
                failed=int(record.get("failed", 0)),
            ),
            metadata=json_metadata(record.get("metadata")),
        )


def json_metadata(text: str | None) -> dict[str, str] | None:
    value = json.loads(text) if text else None
    return value if isinstance(value, dict) else None


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchPublic]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False
