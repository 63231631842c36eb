"""/v1/jobs/{id}/ws: a job's events over a WebSocket, the same events as its server-sent events.

Each message is one JSON object `{"id": <stream entry id>, "event": <name>, "data": {...}}`: `token`
events, then one final `done`, `error`, `cancelled` or `expired` carrying the job as polled, after
which the server closes normally (1000). `?last_event_id=<entry id>` resumes after that event.
Credentials go in the handshake's headers, as on every other route (`Authorization: Bearer` or
`X-API-Key`). The connection is refused by a close code (the reason holds the error code and message):

- 4400: a Host header not in `CONVEYOR_ALLOWED_HOSTS` (`host_not_allowed`, app/api/hosts.py);
- 4403: a browser page of another origin (its `Origin` neither the API's own nor in
  `CONVEYOR_ALLOWED_ORIGINS`: `origin_not_allowed`); a client that sends no Origin is no browser;
- 4401: no credentials, or credentials that do not verify (`unauthorized`);
- 4404: no such job (unknown, expired, or another tenant's);
- 4422: a `last_event_id` that is not an entry id;
- 4429: the tenant already has `CONVEYOR_TENANT_MAX_STREAMS` event streams open;
- 1013 (try again later): Redis does not answer;
- 1000 at once, without a message: the final event was already delivered (resuming after the end).

A follower that disconnects does not cancel the job. Messages from the client are ignored; the
server's WebSocket pings (uvicorn's) keep an idle connection open.
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import suppress

from fastapi import APIRouter, WebSocket, WebSocketDisconnect, status
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from app.api import audit
from app.api.hosts import origin_allowed
from app.api.routes.jobs import checked_event_id
from app.api.service import JobService
from app.api.streams import Slot
from app.core import aio
from app.core.errors import ConveyorError, InvalidRequest, JobNotFound, TooManyStreams, Unauthorized
from app.core.jobview import JobPublic

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

FORBIDDEN_ORIGIN = 4403  # a browser page of an origin not allowed (CONVEYOR_ALLOWED_ORIGINS)
UNAUTHORIZED = 4401  # 4000 + the HTTP status the same refusal has on GET /v1/jobs/{id}/events
NOT_FOUND = 4404
INVALID = 4422
TOO_MANY = 4429  # the tenant has CONVEYOR_TENANT_MAX_STREAMS streams open
MAX_REASON = 123  # bytes a close frame's reason may hold


@router.websocket("/{job_id}/ws")
async def job_ws(websocket: WebSocket, job_id: str, last_event_id: str | None = None) -> None:
    jobs: JobService = websocket.app.state.jobs
    await websocket.accept()
    audit.note(websocket, job_id=job_id)
    origin = websocket.headers.get("origin")
    settings = websocket.app.state.settings
    if not origin_allowed(origin, host=websocket.headers.get("host", ""), allowed=settings.allowed_origins):
        shown = (origin or "")[:60]
        message = f"pages of {shown!r} may not open this API's WebSockets (CONVEYOR_ALLOWED_ORIGINS)"
        await _close(websocket, FORBIDDEN_ORIGIN, f"origin_not_allowed: {message}")
        return
    try:
        after = checked_event_id(last_event_id, "last_event_id")
    except InvalidRequest as exc:
        await _close(websocket, INVALID, f"{exc.code}: {exc.message}")
        return
    try:
        principal = await websocket.app.state.auth.authenticate(websocket.headers)
        audit.note(websocket, tenant=principal.tenant)
        if not await jobs.is_over(job_id, after, tenant=principal.tenant):
            slot = jobs.streams.take(principal.tenant)
            await _follow(websocket, jobs, job_id, after, slot)
    except Unauthorized as exc:
        await _close(websocket, UNAUTHORIZED, f"{exc.code}: {exc.message}")
        return
    except JobNotFound as exc:
        await _close(websocket, NOT_FOUND, f"{exc.code}: {exc.message}")
        return
    except TooManyStreams as exc:
        await _close(websocket, TOO_MANY, f"{exc.code}: {exc.message}")
        return
    except (RedisConnectionError, RedisTimeoutError):
        log.warning("Redis unreachable while streaming job %s", job_id)
        await _close(websocket, status.WS_1013_TRY_AGAIN_LATER, "unavailable: the job store does not answer")
        return
    except ConveyorError as exc:
        await _close(websocket, status.WS_1011_INTERNAL_ERROR, f"{exc.code}: {exc.message}")
        return
    except WebSocketDisconnect:
        return
    await _close(websocket, status.WS_1000_NORMAL_CLOSURE, "")


async def _follow(websocket: WebSocket, jobs: JobService, job_id: str, after: str | None, slot: Slot) -> None:
    """Send the events until the final one, or until the client goes away (then stop reading Redis)."""

    async def send() -> None:
        async for event in jobs.events(job_id, after, slot=slot):
            data = event.data
            if event.record is not None:  # the final event: the job as it ended
                audit.note_job(websocket, event.record)
                data = JobPublic.from_record(event.record).model_dump(mode="json")
            message = {"id": event.id, "event": event.event, "data": data}
            await websocket.send_text(json.dumps(message, separators=(",", ":"), ensure_ascii=False))

    async def until_gone() -> None:
        while (await websocket.receive())["type"] != "websocket.disconnect":
            pass  # the client has nothing to say; its messages are dropped

    sender, listener = asyncio.ensure_future(send()), asyncio.ensure_future(until_gone())
    try:
        done, _ = await asyncio.wait({sender, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (sender, listener):
            await aio.stop(task)
    if not listener.cancelled():
        listener.exception()  # a receive after the end may raise: the client is gone either way
    if sender not in done:
        raise WebSocketDisconnect()
    sender.result()  # its error, if it failed


async def _close(websocket: WebSocket, code: int, reason: str) -> None:
    with suppress(WebSocketDisconnect, RuntimeError):  # the client may already be gone
        await websocket.close(code, reason.encode()[:MAX_REASON].decode(errors="ignore"))
