"""Who may address the API: the Host allow-list (`CONVEYOR_ALLOWED_HOSTS`) for every request, and the
browser Origins (`CONVEYOR_ALLOWED_ORIGINS`) a job's WebSocket accepts (app/api/routes/ws.py).

A page an attacker serves can point its own name at this machine (DNS rebinding) and then talk to
an API it reaches as if it were its own origin: a laptop's open API (`make run`) included. The
browser still sends the attacker's name as the Host, so an API that answers only its own names
gives such a page nothing. A WebSocket is not held by the same-origin policy at all: any page may
open one, so the handshake's Origin is checked against the API's own and the allowed ones.

The app factory (app/api/app.py) installs `HostMiddleware`: a request with another Host is answered
400 `host_not_allowed` (a WebSocket: accepted, then closed 4400 with that code), health, readiness
and /metrics excepted."""

from __future__ import annotations

from collections.abc import Iterable

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from app.api.errors import problem

HOST_NOT_ALLOWED = 4400  # 4000 + the status the same refusal has over HTTP
# Probes and scrapers address a pod by its IP (kubelet, Prometheus); these answer anyone and change nothing.
ANY_HOST_PATHS = frozenset({"/health", "/healthz", "/readyz", "/metrics"})


def host_name(host: str) -> str:
    """The name of a Host header, without its port, lower case: `[::1]:8000` -> `::1`."""
    host = host.strip().lower()
    if host.startswith("["):  # an IPv6 literal, its port after the bracket
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def host_allowed(host: str, allowed: Iterable[str]) -> bool:
    """Whether a request's Host header names one of `allowed`: a name (any port), `.example.com` (it
    and its subdomains) or `*`. An absent or empty Host is allowed by `*` only."""
    name = host_name(host)
    for entry in (a.strip().lower() for a in allowed):
        if entry == "*":
            return True
        if not name:
            continue
        if entry.startswith("."):
            if name == entry[1:] or name.endswith(entry):
                return True
        elif name == host_name(entry):
            return True
    return False


def origin_allowed(origin: str | None, *, host: str, allowed: Iterable[str]) -> bool:
    """Whether a WebSocket handshake's Origin may open it: none (not a browser), the API's own (its
    host and port are the request's Host), or one of `allowed` (`scheme://host[:port]`, or `*`)."""
    if origin is None:
        return True
    origin = origin.strip().lower().rstrip("/")
    if "://" in origin and origin.split("://", 1)[1] == host.strip().lower():
        return True
    return any(entry == "*" or entry.strip().lower().rstrip("/") == origin for entry in allowed)


class HostMiddleware:
    """Answers a request whose Host is not in `allowed` with 400 `host_not_allowed`, before any route."""

    def __init__(self, app: ASGIApp, *, allowed: Iterable[str]) -> None:
        self.app = app
        self.allowed = tuple(allowed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("path", "") in ANY_HOST_PATHS:
            await self.app(scope, receive, send)
            return
        host = Headers(scope=scope).get("host", "")
        if host_allowed(host, self.allowed):
            await self.app(scope, receive, send)
            return
        message = (
            f"the Host header {host[:100]!r} is not one this API answers; add its name to "
            "CONVEYOR_ALLOWED_HOSTS to serve it"
        )
        if scope["type"] == "http":
            await problem(400, "host_not_allowed", message)(scope, receive, send)
            return
        await receive()  # websocket.connect; refusals are close codes, as the route's own are
        await send({"type": "websocket.accept"})
        reason = f"host_not_allowed: {message}".encode()[:123].decode(errors="ignore")
        await send({"type": "websocket.close", "code": HOST_NOT_ALLOWED, "reason": reason})
