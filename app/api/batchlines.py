"""The lines of a Batch API input file and of its output and error files, in OpenAI's format: an input
line checked (`parse_line`, a `LineError` naming what is wrong), an answer's line (`output_line`),
a request's that got none (`error_line`). The feeder (app/api/batchfeed.py) reads and writes them."""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from app.api.chat_schemas import ChatCompletionCreate
from app.api.openai_schemas import CompletionCreate, OpenAIRequest
from app.api.routes.embeddings import EmbeddingsCreate

EMBEDDINGS = "/v1/embeddings"
SCHEMAS: dict[str, type[OpenAIRequest] | type[EmbeddingsCreate]] = {
    "/v1/chat/completions": ChatCompletionCreate,
    "/v1/completions": CompletionCreate,
    EMBEDDINGS: EmbeddingsCreate,
}


class LineError(Exception):
    """A line of an input file that a batch cannot run: OpenAI's `errors.data` entry."""

    def __init__(self, code: str, message: str, *, line: int, param: str | None = None) -> None:
        super().__init__(message)
        self.entry = {"code": code, "message": message, "param": param, "line": line}


def parse_line(text: str, *, number: int, endpoint: str, seen: set[str]) -> dict[str, Any]:
    """One input line as `{"custom_id", "body"}`, or LineError saying what is wrong (`number`: 1-based)."""
    try:
        value = json.loads(text)
    except ValueError:
        raise LineError("invalid_json_line", "this line is not valid JSON", line=number) from None
    if not isinstance(value, dict):
        raise LineError("invalid_json_line", "this line is not a JSON object", line=number)
    custom_id = value.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError(
            "missing_required_parameter",
            "custom_id must be a non-empty string",
            line=number,
            param="custom_id",
        )
    if custom_id in seen:
        raise LineError(
            "duplicate_custom_id",
            f"custom_id {custom_id[:64]!r} is used twice",
            line=number,
            param="custom_id",
        )
    seen.add(custom_id)
    if value.get("method") != "POST":
        raise LineError("invalid_method", "method must be POST", line=number, param="method")
    if value.get("url") != endpoint:
        raise LineError(
            "mismatched_url", f"url must be the batch's endpoint, {endpoint}", line=number, param="url"
        )
    body = value.get("body")
    if not isinstance(body, dict):
        raise LineError("invalid_request", "body must be a JSON object", line=number, param="body")
    try:
        request = SCHEMAS[endpoint].model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise LineError(
            "invalid_request", f"body.{where}: {first['msg']}", line=number, param=f"body.{where}"
        ) from None
    if getattr(request, "stream", False):
        raise LineError(
            "invalid_request", "stream is not supported in a batch", line=number, param="body.stream"
        )
    return {"custom_id": custom_id, "body": body}


def output_line(job_id: str, custom_id: str, *, status_code: int, body: dict[str, Any]) -> str:
    """OpenAI's output (or error) line for a request that was answered."""
    response = {"status_code": status_code, "request_id": job_id, "body": body}
    return json.dumps(
        {"id": f"batch_req_{job_id}", "custom_id": custom_id, "response": response, "error": None},
        ensure_ascii=False,
    )


def error_line(job_id: str, custom_id: str, *, code: str, message: str) -> str:
    """OpenAI's error line for a request that got no answer (its job failed, was cancelled, expired)."""
    error = {"code": code, "message": message}
    return json.dumps(
        {"id": f"batch_req_{job_id}", "custom_id": custom_id, "response": None, "error": error},
        ensure_ascii=False,
    )
