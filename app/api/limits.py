"""Request body size: refused with 413 `payload_too_large` past `max_body_bytes`, on the declared
Content-Length (before anything is read) and on the bytes actually streamed (chunked bodies)."""

from __future__ import annotations

from collections.abc import Mapping

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.errors import problem


class BodyTooLarge(HTTPException):
    """Raised while the route reads the body; FastAPI passes HTTPExceptions on to the error boundary
    (app/api/errors.py), which answers 413 with the limit in the message and `details.limit`."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, message(limit))
        self.details = {"limit": limit}


def message(limit: int) -> str:
    return f"the request body is larger than the limit of {limit} bytes"


class BodyLimitMiddleware:
    """`limit` for every path but those of `paths`, which have their own (a file upload's)."""

    def __init__(self, app: ASGIApp, *, limit: int, paths: Mapping[str, int] | None = None) -> None:
        self.app = app
        self.limit = limit
        self.paths = dict(paths or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.paths.get(scope.get("path", ""), self.limit)
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await problem(413, "payload_too_large", message(limit), limit=limit)(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return msg

        await self.app(scope, counted, send)
