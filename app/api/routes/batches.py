"""OpenAI's Batch API: /v1/files (JSONL uploads, purpose `batch`) and /v1/batches.

A tenant sees only its own files and batches: another's id is 404, as an unknown one. The records
are the batch store's (app/core/batchstore.py); the lines become jobs through the batch feeder
(app/api/batchfeed.py), which runs beside this API.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Depends, File, Form, Query, Request, UploadFile
from fastapi.responses import Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.types import Receive, Scope, Send

from app.api.auth import current_tenant
from app.api.batch_schemas import BatchCreate, BatchList, BatchPublic, FileDeleted, FileObject
from app.api.deps import get_jobs, get_settings
from app.api.limits import BodyTooLarge
from app.api.routes.jobs import BODY_ERRORS, ERRORS, ErrorBody
from app.api.routes.openai import OpenAIRoute
from app.api.service import JobService
from app.core import batchstore as bs
from app.core.batchstore import BatchStore
from app.core.config import Settings
from app.core.errors import BatchFinished, InvalidRequest, NotServed


class BatchRoute(OpenAIRoute):
    """A 405 names in `Allow` every method of the path (RFC 9110), not only this route's: here one path
    has several routes (GET and DELETE /v1/files/{id}, GET and POST /v1/batches)."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.methods and scope["method"] not in self.methods:
            same = [r for r in router.routes if isinstance(r, APIRoute) and r.path_format == self.path_format]
            methods = {m for r in same for m in r.methods or ()} | self.methods
            raise HTTPException(status_code=405, headers={"Allow": ", ".join(sorted(methods))})
        await super().handle(scope, receive, send)


router = APIRouter(prefix="/v1", tags=["batches"], route_class=BatchRoute)
UPLOAD_ERRORS: dict[int | str, dict[str, Any]] = {**BODY_ERRORS, 429: {"model": ErrorBody}}


def get_batches(request: Request) -> BatchStore:
    return request.app.state.batches  # type: ignore[no-any-return]


@router.post("/files", response_model=FileObject, responses=UPLOAD_ERRORS)
async def upload_file(
    file: UploadFile = File(description="JSONL: one request a line (OpenAI's batch input format)."),
    purpose: Literal["batch"] = Form(description="`batch`: the only purpose stored here."),
    settings: Settings = Depends(get_settings),
    store: BatchStore = Depends(get_batches),
    tenant: str = Depends(current_tenant),
) -> FileObject:
    """Store a batch input file (at most `batch_file_max_bytes`, else 413, 50,000 lines),
    counted against the tenant's quota of 8 x `batch_file_max_bytes` (429 file_quota_exceeded past it). Its
    lines are checked when a batch is created from it."""
    limit = settings.batch.file_max_bytes
    content = await file.read(limit + 1)
    if len(content) > limit:
        raise BodyTooLarge(limit)
    try:
        lines = content.decode().count("\n") + (not content.endswith(b"\n"))
    except UnicodeDecodeError:
        raise InvalidRequest("the file is not UTF-8 text (JSONL)") from None
    if lines > bs.FILE_MAX_LINES:
        limit = bs.FILE_MAX_LINES
        raise InvalidRequest(f"the file has {lines} lines, over the limit of {limit}", limit=limit)
    name = (file.filename or "input.jsonl")[:256]
    stored = await store.put_file(
        tenant=tenant, filename=name, purpose=purpose, content=content, quota=settings.batch.tenant_file_bytes
    )
    return FileObject.of(stored)


@router.get("/files/{file_id}", response_model=FileObject, responses=ERRORS)
async def get_file(
    file_id: str, store: BatchStore = Depends(get_batches), tenant: str = Depends(current_tenant)
) -> FileObject:
    return FileObject.of(await store.file(file_id, tenant=tenant))


@router.get(
    "/files/{file_id}/content",
    response_class=Response,
    responses={**ERRORS, 200: {"content": {"application/jsonl": {}}, "description": "The file's bytes."}},
)
async def file_content(
    file_id: str, store: BatchStore = Depends(get_batches), tenant: str = Depends(current_tenant)
) -> Response:
    """The file's bytes: an input file as uploaded, or a batch's output or error lines."""
    return Response(await store.content(file_id, tenant=tenant), media_type="application/jsonl")


@router.delete("/files/{file_id}", response_model=FileDeleted, responses=ERRORS)
async def delete_file(
    file_id: str, store: BatchStore = Depends(get_batches), tenant: str = Depends(current_tenant)
) -> FileDeleted:
    """Delete the file; its bytes stop counting against the tenant's quota."""
    await store.delete_file(file_id, tenant=tenant)
    return FileDeleted(id=file_id)


@router.post("/batches", response_model=BatchPublic, responses={**BODY_ERRORS, 503: {"model": ErrorBody}})
async def create_batch(
    body: BatchCreate,
    settings: Settings = Depends(get_settings),
    store: BatchStore = Depends(get_batches),
    jobs: JobService = Depends(get_jobs),
    tenant: str = Depends(current_tenant),
) -> BatchPublic:
    """A batch of the input file's requests, `validating` first: its lines are checked, then run as
    `batch`-class jobs of the tenant as the queue has room, within the completion window. With a
    `callback_url`, the batch's end is sent there as one signed webhook event."""
    stored = await store.file(body.input_file_id, tenant=tenant)
    if body.endpoint == "/v1/embeddings" and settings.embedding_stages <= 0:
        raise NotServed("embeddings are not served here (CONVEYOR_EMBEDDING_STAGES=0)")
    if stored.purpose != "batch":
        raise InvalidRequest(f"file {stored.id} is not a batch input file (purpose {stored.purpose!r})")
    if body.callback_url is not None:  # the SSRF guard (DNS included) before anything is written
        await jobs.callbacks.check(body.callback_url, None, tenant=tenant)
    record = await store.create(
        tenant=tenant,
        input_file_id=stored.id,
        endpoint=body.endpoint,
        window=body.completion_window,
        metadata=body.metadata,
        callback_url=body.callback_url,
    )
    return BatchPublic.of(record)


@router.get("/batches", response_model=BatchList, responses=ERRORS)
async def list_batches(
    after: str | None = Query(
        default=None, max_length=64, description="The last batch id of the previous page."
    ),
    limit: int = Query(default=20, ge=1, le=100),
    store: BatchStore = Depends(get_batches),
    tenant: str = Depends(current_tenant),
) -> BatchList:
    """The tenant's batches, newest first."""
    records, more = await store.page(tenant, after=after, limit=limit)
    data = [BatchPublic.of(r) for r in records]
    return BatchList(
        data=data,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
        has_more=more,
    )


@router.get("/batches/{batch_id}", response_model=BatchPublic, responses=ERRORS)
async def get_batch(
    batch_id: str, store: BatchStore = Depends(get_batches), tenant: str = Depends(current_tenant)
) -> BatchPublic:
    return BatchPublic.of(await store.batch(batch_id, tenant=tenant))


@router.post(
    "/batches/{batch_id}/cancel", response_model=BatchPublic, responses={**ERRORS, 409: {"model": ErrorBody}}
)
async def cancel_batch(
    batch_id: str, store: BatchStore = Depends(get_batches), tenant: str = Depends(current_tenant)
) -> BatchPublic:
    """`cancelling`: no more lines are fed, its jobs not ended are cancelled, then it ends `cancelled`
    with the files of what was done. A batch that has ended (or is ending) is 409 batch_finished."""
    await store.batch(batch_id, tenant=tenant)
    moved, had = await store.move(batch_id, bs.CANCELLING)
    if not moved and had != bs.CANCELLING:
        raise BatchFinished(
            f"batch {batch_id} is {had}; it cannot be cancelled", batch_id=batch_id, status=had
        )
    return BatchPublic.of(await store.batch(batch_id, tenant=tenant))
