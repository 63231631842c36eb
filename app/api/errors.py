"""The API's one error boundary: every failure becomes JSON with a stable `code`."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.core import metrics
from app.core.errors import RETRY_AFTER_S, ConveyorError, Refused, StoreFull, Unavailable
from app.core.redis import is_out_of_memory

log = logging.getLogger(__name__)

HTTP_CODES = {
    400: "bad_request",
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
    415: "unsupported_media_type",
}


# Room comes back as ended jobs expire, over minutes, not at once: ask clients for more patience
# than a busy queue needs.
STORE_FULL_RETRY_S = 30.0


def problem(
    status: int, code: str, message: str, headers: Mapping[str, str] | None = None, **details: object
) -> JSONResponse:
    error: dict[str, object] = {"code": code, "message": message}
    if details:
        error["details"] = jsonable_encoder(details)
    return JSONResponse({"error": error}, status_code=status, headers=headers)


def error_response(exc: ConveyorError) -> JSONResponse:
    if isinstance(exc, Refused):
        metrics.ADMISSION_REFUSED.labels(exc.code).inc()
    return JSONResponse(jsonable_encoder(exc.body()), status_code=exc.status, headers=exc.headers() or None)


def install(app: FastAPI) -> None:
    @app.exception_handler(ConveyorError)
    async def conveyor_error(_: Request, exc: ConveyorError) -> JSONResponse:
        if exc.status >= 500 and exc.retry_after_s is None:  # a refusal is the service working
            log.error("request failed: %s", exc.message)
        return error_response(exc)

    async def redis_unreachable(request: Request, exc: Exception) -> JSONResponse:
        # Any request that meets a Redis that does not answer. A submit is one script, so it was
        # queued whole or not at all; if only its reply was lost, a retry with the same
        # Idempotency-Key answers the job it made.
        log.warning("Redis unreachable: %s: %s", type(exc).__name__, exc)
        return error_response(
            Unavailable("the job store (Redis) does not answer; retry shortly", retry_after_s=RETRY_AFTER_S)
        )

    app.add_exception_handler(RedisConnectionError, redis_unreachable)
    app.add_exception_handler(RedisTimeoutError, redis_unreachable)

    @app.exception_handler(ResponseError)
    async def redis_refused(request: Request, exc: ResponseError) -> JSONResponse:
        # Redis at its maxmemory refuses writes (policy noeviction): redis-py raises OutOfMemoryError
        # for a command, a ResponseError quoting "-OOM" for a script. A script is refused at its first
        # write and a MULTI as a whole, so nothing was half written; reads go on, and writes resume as
        # ended jobs expire. Any other ResponseError is a bug: 500.
        if not is_out_of_memory(exc):
            return await unexpected(request, exc)
        log.warning("Redis is at its memory limit (maxmemory); refusing a write: %s", exc)
        if (jobs := getattr(request.app.state, "jobs", None)) is not None:
            jobs.admission.refused_for_memory()
        return error_response(
            StoreFull(
                "the job store (Redis) is full and takes no new work; retry later",
                retry_after_s=STORE_FULL_RETRY_S,
            )
        )

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [
            {"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
            for e in exc.errors()
        ]
        first = errors[0] if errors else {"loc": [], "msg": "invalid request"}
        where = ".".join(str(p) for p in first["loc"] if p != "body")
        return problem(
            422, "invalid_request", f"{where}: {first['msg']}" if where else str(first["msg"]), errors=errors
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        details = getattr(exc, "details", None) or {}  # BodyTooLarge (app/api/limits.py) states its limit
        # Kept: the router's 405 names the methods the path has in `Allow` (RFC 9110 requires it).
        code = HTTP_CODES.get(exc.status_code, "http_error")
        return problem(exc.status_code, code, str(exc.detail), headers=exc.headers, **details)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return problem(500, "internal_error", "internal error; the server log has the details")
