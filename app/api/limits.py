"""Request bodies: refused with 413 `payload_too_large` past `max_body_bytes`, on the declared
Content-Length (before anything is read) and on the bytes actually streamed (chunked bodies); and a
JSON body holding a lone UTF-16 surrogate escape (`"\\ud800"`) with 400 `bad_request`.

JSON lets a string spell half of a surrogate pair, which Python decodes into a `str` that no encoder
takes: the tokenizer, Redis and the audit log would each fail on it later, as a 500, or store it
half-written. Such text is no Unicode, so it is refused where the body comes in, for every route."""

from __future__ import annotations

import re
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


class LoneSurrogate(HTTPException):
    """Raised while the route reads a JSON body that spells a lone surrogate; answered 400."""

    def __init__(self) -> None:
        super().__init__(
            400,
            "the JSON body holds a lone UTF-16 surrogate escape (such as \\ud800 without its pair): "
            "strings must be valid Unicode",
        )


# A JSON escape: `\uXXXX` (its code point in group 1) or a backslash and any one character. Read left
# to right, an escaped backslash (`\\`) is consumed whole, so `\\ud800` is no escape.
ESCAPE = re.compile(rb"\\(?:u([0-9a-fA-F]{4})|.)", re.DOTALL)


def has_lone_surrogate(body: bytes) -> bool:
    """Whether a JSON text spells a high surrogate not directly followed by a low one, or a low one
    not directly after a high one."""
    if b"\\u" not in body:
        return False
    paired_at = -1  # where a high surrogate's escape ends: the low one must start there
    for escape in ESCAPE.finditer(body):
        code = int(escape[1], 16) if escape[1] else None
        low = code is not None and 0xDC00 <= code <= 0xDFFF
        if paired_at >= 0:
            if not (low and escape.start() == paired_at):
                return True
            paired_at = -1
            continue
        if code is not None and 0xD800 <= code <= 0xDBFF:
            paired_at = escape.end()
        elif low:
            return True
    return paired_at >= 0


def is_json(headers: Headers) -> bool:
    """A body FastAPI reads as JSON: declared so, or not declared at all."""
    kind = headers.get("content-type", "").split(";")[0].strip().lower()
    return not kind or kind == "application/json" or kind.endswith("+json")


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
        chunks: list[bytes] | None = [] if is_json(Headers(scope=scope)) else None

        async def counted() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                body = msg.get("body", b"")
                seen += len(body)
                if seen > limit:
                    raise BodyTooLarge(limit)
                if chunks is not None:
                    chunks.append(body)
                    if not msg.get("more_body", False) and has_lone_surrogate(b"".join(chunks)):
                        raise LoneSurrogate()
            return msg

        await self.app(scope, counted, send)
