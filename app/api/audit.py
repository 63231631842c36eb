"""The audit log: one structured entry per API request, as a JSON line (logger `conveyor.audit`) and
in the capped `audit` stream in Redis (MAXLEN ~ `audit_maxlen`).

An entry holds the time, tenant, method, path, status (a WebSocket's close code), duration, client
address, and where the request touched a job: its model, id and prompt and output token counts (as
they stood when the request ended), and the prompt text only with `audit_prompts`. Routes add what
they learn with `note`/`note_job`; the middleware writes the entry once the response has been sent
(for a stream: once it ends). A request refused before its tenant was known (a 401) goes to a
stream of its own (`audit:unauthenticated`, capped apart): a flood of them from anyone without a
key cannot roll the tenants' entries out of `audit`. Probes (/health, /healthz, /readyz) are not
audited: they would drown the rest.
An audit write that fails (Redis away) is logged and never fails the request.
"""

from __future__ import annotations

import json
import logging
import time
from datetime import UTC, datetime
from typing import Any

from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.core.jobrecord import JobRecord
from app.core.keys import Keys

log = logging.getLogger(__name__)
AUDIT = logging.getLogger("conveyor.audit")

UNAUDITED = frozenset({"/health", "/healthz", "/readyz"})
# Requests refused before a tenant was known go to a stream of their own, capped at this, so that
# anyone without a key cannot push the tenants' entries out of the capped `audit` stream.
UNAUTHENTICATED_MAXLEN = 10_000
STATE_KEY = "audit"  # the request's notes, in scope["state"] (what request.state reads)


def fields(connection: HTTPConnection | Scope) -> dict[str, Any]:
    """The request's notes (shared by the routes and the middleware)."""
    scope = connection.scope if isinstance(connection, HTTPConnection) else connection
    notes: dict[str, Any] = scope.setdefault("state", {}).setdefault(STATE_KEY, {})
    return notes


def note(connection: HTTPConnection, **values: Any) -> None:
    fields(connection).update({k: v for k, v in values.items() if v is not None})


def note_job(connection: HTTPConnection | dict[str, Any], record: JobRecord) -> None:
    """The job a request touched: id, model and token counts from its record."""
    notes = connection if isinstance(connection, dict) else fields(connection)
    notes.update(
        job_id=record.id,
        model=record.model,
        prompt_tokens=record.prompt_tokens or 0,
        completion_tokens=record.completion_tokens or 0,
    )


def entry(
    scope: Scope, notes: dict[str, Any], *, at: float, duration_s: float, status: int, with_prompt: bool
) -> dict[str, Any]:
    """The audit entry of one request (pure: what the middleware writes)."""
    client = scope.get("client")
    out: dict[str, Any] = {
        "time": datetime.fromtimestamp(at, UTC).isoformat(timespec="milliseconds"),
        "tenant": notes.get("tenant", ""),
        "method": scope.get("method", "WS"),
        "path": scope.get("path", ""),
        "status": status,
        "duration_ms": round(duration_s * 1000, 2),
        "client": f"{client[0]}:{client[1]}" if client else "",
    }
    for name in ("model", "job_id", "prompt_tokens", "completion_tokens"):
        if notes.get(name) is not None:
            out[name] = notes[name]
    if with_prompt and notes.get("prompt") is not None:
        out["prompt"] = notes["prompt"]
    return out


class AuditMiddleware:
    """Pure ASGI (streams pass through untouched): times the request, catches its status, writes
    the entry after the last byte. Outermost of the app's own middleware, so a 401 or 413 is audited."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("path") in UNAUDITED:
            await self.app(scope, receive, send)
            return
        at, started = time.time(), time.perf_counter()
        notes = fields(scope)  # made before the app runs, so every copy of the scope shares it
        status: int | None = None

        async def watch(message: Message) -> None:
            nonlocal status
            if message["type"] in ("http.response.start", "websocket.http.response.start"):
                status = message["status"]
            elif message["type"] == "websocket.close":
                status = message.get("code", 1000)
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except BaseException:
            status = status or 500
            raise
        finally:
            default = 1000 if scope["type"] == "websocket" else 500  # a client that left a WebSocket
            await self._write(scope, notes, at, time.perf_counter() - started, status or default)

    async def _write(
        self, scope: Scope, notes: dict[str, Any], at: float, duration_s: float, status: int
    ) -> None:
        state = scope["app"].state
        settings = state.settings
        line = entry(
            scope,
            notes,
            at=at,
            duration_s=duration_s,
            status=status,
            with_prompt=settings.audit.prompts,
        )
        AUDIT.info(json.dumps(line, separators=(",", ":"), ensure_ascii=False))
        redis = getattr(state, "redis", None)
        if redis is None:
            return
        try:
            stream = {k: v if isinstance(v, str) else json.dumps(v) for k, v in line.items()}
            keys = Keys(settings.namespace)
            if line["tenant"]:
                name, maxlen = keys.audit(), settings.audit.maxlen
            else:
                name, maxlen = keys.audit_unauthenticated(), UNAUTHENTICATED_MAXLEN
            await redis.xadd(name, stream, maxlen=maxlen, approximate=True)
        except Exception as exc:  # the request has been answered; the JSON line above still holds it
            log.warning("audit entry not written to Redis: %s: %s", type(exc).__name__, exc)
