"""The api's Prometheus side: a middleware that counts and times requests, and `GET /metrics`.

Requests are labelled by route template (`/v1/jobs/{job_id}`), never by raw path, so a label's
values stay bounded; a path that matches no route is `unmatched`. `GET /metrics` first reads from
Redis what no single process observes: jobs waiting per class, live workers per stage, each
breaker's state; a Redis that does not answer leaves those gauges as they were.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from redis.exceptions import RedisError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.core import metrics
from app.core.breaker import State
from app.core.keys import PRIORITIES, Keys

log = logging.getLogger(__name__)

router = APIRouter(tags=["operations"])
INTAKE_MODEL = "all"  # the intake streams are per class, shared by every model


class MetricsMiddleware:
    """Counts every HTTP request by route template, method and status, and times it to its end."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # what the client gets if the app raises before answering

        async def tracked(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            method = scope.get("method", "")
            metrics.HTTP_REQUESTS.labels(template, method, str(status)).inc()
            metrics.HTTP_DURATION.labels(template, method).observe(time.perf_counter() - started)


@router.get("/metrics", include_in_schema=False)
async def scrape(request: Request) -> Response:
    """Prometheus text exposition of this api process (not authenticated, like /healthz)."""
    try:
        await refresh(request.app.state.redis, request.app.state.settings)
    except RedisError as exc:
        log.warning("metrics: Redis gauges not refreshed: %s", exc)
    return Response(metrics.exposition(), media_type=metrics.CONTENT_TYPE)


async def refresh(redis: Any, settings: Any) -> None:
    keys = Keys(settings.namespace)
    models = sorted({settings.default_model, *settings.models})
    now = time.time()
    pipe = redis.pipeline(transaction=False)
    for priority in PRIORITIES:
        pipe.xlen(keys.intake(priority))
    for model in models:
        for stage in range(settings.stages):
            pipe.zcount(keys.workers(model, stage), now - settings.heartbeat_ttl_s, "+inf")
        pipe.hget(keys.breaker(model), "state")
    replies = iter(await pipe.execute())
    for priority in PRIORITIES:
        metrics.INTAKE_DEPTH.labels(INTAKE_MODEL, priority).set(int(next(replies)))
    for model in models:
        for stage in range(settings.stages):
            metrics.WORKERS_LIVE.labels(model, str(stage)).set(int(next(replies)))
        state = next(replies)
        name = state.decode() if isinstance(state, bytes) else (state or State.CLOSED)
        metrics.BREAKER_STATE.labels(model).set(metrics.BREAKER_STATES.get(str(name), 0))
