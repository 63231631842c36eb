"""The API process's connections: how long a client may take to send a request, and how many
connections it may hold. `conveyor api` (app/cli.py `api`) serves with uvicorn through `serving`.

uvicorn times out only the idle wait between two requests of a kept-alive connection
(`timeout_keep_alive`, and any byte received disarms it): a connection that never finishes its
headers holds a file descriptor for ever, so 20,000 of them exhausted the process's descriptors
and the API stopped accepting anyone. Here:

- the soft limit of open files is raised to the hard limit at start (`raise_fd_limit`);
- a connection has `HEADER_TIMEOUT_S` from its start, and from the end of each response, to send
  its next request's headers; then it is closed (`RequestGuard`);
- at most three quarters of the connections the descriptors allow wait for a request; past that
  the one that has waited longest is closed for the newcomer, so idle connections can never keep a
  client out;
- past `max_connections`, what a request gets is uvicorn's `limit_concurrency`: a fast 503.

The supported front is a reverse proxy (deploy/nginx/nginx.conf) with its own header and body
timeouts and per-client connection caps; this guard keeps the API standing without one.
"""

from __future__ import annotations

import asyncio
import resource
from typing import Any

KEEP_ALIVE_S = 5  # uvicorn's default: the idle wait between two requests of one connection
# Seconds a client has (from its connection's start, and from each answer's end) to send a request's
# headers before the API closes it: generous to a slow link, short for an attacker holding
# connections open.
HEADER_TIMEOUT_S = 10.0
# Descriptors kept for what is not a client: the Redis pool (100), model and tokenizer files,
# logs, the threads' pipes and the pub/sub connection.
RESERVED_FDS = 512


def raise_fd_limit() -> int:
    """Raise this process's soft limit of open files to its hard limit; the soft limit after it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError):  # an unlimited hard limit over the kernel's nr_open: keep it
            pass
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def max_connections(fds: int) -> int:
    """Client connections a process with `fds` descriptors may hold: all but the reserved ones, and
    at least half of them."""
    return max(fds - RESERVED_FDS, fds // 2)


class RequestGuard(asyncio.Protocol):
    """Mixed into uvicorn's HTTP protocol (httptools or h11; `guarded` makes the class). The class
    attributes are set there; `waiting` holds, oldest first, the connections of the server that wait
    for a request (a stale entry, whose request began since, is dropped when met)."""

    header_timeout_s: float
    max_waiting: int
    waiting: dict[RequestGuard, None]
    # uvicorn's protocol's own attributes, read here
    transport: asyncio.Transport
    cycle: Any
    connections: set[Any]
    _request_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._await_request()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        if not self.transport.is_closing():
            self._await_request()

    def handle_websocket_upgrade(self, *args: Any) -> None:
        self._disarm()  # the WebSocket protocol takes the connection over
        super().handle_websocket_upgrade(*args)  # type: ignore[misc]

    def _idle(self) -> bool:
        return self.cycle is None or bool(self.cycle.response_complete)

    def _await_request(self) -> None:
        self._disarm()
        loop = asyncio.get_running_loop()
        self._request_timer = loop.call_later(self.header_timeout_s, self._request_late)
        self.waiting[self] = None
        while len(self.waiting) > self.max_waiting:
            oldest = next(iter(self.waiting))
            oldest._disarm()
            if oldest._idle():
                oldest._close()

    def _request_late(self) -> None:
        self._request_timer = None
        self.waiting.pop(self, None)
        if self._idle():
            self._close()

    def _disarm(self) -> None:
        self.waiting.pop(self, None)
        if self._request_timer is not None:
            self._request_timer.cancel()
            self._request_timer = None

    def _close(self) -> None:
        self.connections.discard(self)  # counted out now: uvicorn's limit_concurrency reads this set
        if not self.transport.is_closing():
            self.transport.close()


def guarded(*, header_timeout_s: float, max_connections: int) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (httptools where installed, as uvicorn's `auto` chooses, else h11)
    with the RequestGuard, for one server."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base  # type: ignore[assignment]
    attributes = {
        "header_timeout_s": header_timeout_s,
        "max_waiting": max(1, max_connections * 3 // 4),
        "waiting": {},
    }
    return type(f"Guarded{base.__name__}", (RequestGuard, base), attributes)


def serving() -> dict[str, Any]:
    """uvicorn's options for the API's connections; raises the descriptor limit first."""
    cap = max_connections(raise_fd_limit())
    return {
        "http": guarded(header_timeout_s=HEADER_TIMEOUT_S, max_connections=cap),
        "limit_concurrency": cap,
        "timeout_keep_alive": KEEP_ALIVE_S,
    }
