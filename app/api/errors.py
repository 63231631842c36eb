"""The API's one error boundary: every failure becomes JSON with a stable `code`."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.core.errors import ConveyorError

log = logging.getLogger(__name__)

HTTP_CODES = {
    400: "bad_request",
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
    415: "unsupported_media_type",
}


def problem(status: int, code: str, message: str, **details: object) -> JSONResponse:
    error: dict[str, object] = {"code": code, "message": message}
    if details:
        error["details"] = jsonable_encoder(details)
    return JSONResponse({"error": error}, status_code=status)


def install(app: FastAPI) -> None:
    @app.exception_handler(ConveyorError)
    async def conveyor_error(_: Request, exc: ConveyorError) -> JSONResponse:
        if exc.status >= 500:
            log.error("request failed: %s", exc.message)
        return JSONResponse(jsonable_encoder(exc.body()), status_code=exc.status)

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
        return problem(exc.status_code, HTTP_CODES.get(exc.status_code, "http_error"), str(exc.detail))

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return problem(500, "internal_error", "internal error; the server log has the details")
