"""Request body size: refused with 413 `payload_too_large` past `max_body_bytes`, on the declared
Content-Length (before anything is read) and on the bytes actually streamed (chunked bodies)."""

from __future__ import annotations

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
    def __init__(self, app: ASGIApp, *, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await problem(413, "payload_too_large", message(self.limit), limit=self.limit)(
                scope, receive, send
            )
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    raise BodyTooLarge(self.limit)
            return msg

        await self.app(scope, counted, send)
