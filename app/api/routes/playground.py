"""The playground: one static page (app/api/static/playground.html) where a person tries the API.

It needs no credentials to load; the requests it makes carry the API key typed into it, so it
works with auth on or off. No build step: the page is plain HTML with inline JS and CSS.

The page is served with headers that keep it to itself: a Content-Security-Policy that runs only
its own inline script (named by its SHA-256, so an injected one does not run), talks only to this
origin and may not be framed by another site, and `nosniff` / `no-referrer`. The API starts open on
a laptop, so the one page it serves must not be a way in for another site.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import re
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import RedirectResponse, Response

PAGE = Path(__file__).resolve().parent.parent / "static" / "playground.html"

router = APIRouter(tags=["playground"], include_in_schema=False)


@router.get("/")
async def root() -> RedirectResponse:
    """A browser pointed at the API lands on the playground."""
    return RedirectResponse("/playground", status_code=307)


@router.get("/playground")
async def playground() -> Response:
    page, headers = _page()
    return Response(page, media_type="text/html; charset=utf-8", headers=headers)


@functools.cache
def _page() -> tuple[bytes, dict[str, str]]:
    """The page and its headers, read once."""
    page = PAGE.read_bytes()
    return page, security_headers(page)


def security_headers(page: bytes) -> dict[str, str]:
    """The headers the page is served with; its inline scripts are allowed by their SHA-256."""
    scripts = re.findall(rb"<script>(.*?)</script>", page, re.S)
    hashes = " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(s).digest()).decode()}'" for s in scripts)
    policy = "; ".join(
        [
            "default-src 'none'",
            f"script-src {hashes}",
            "style-src 'unsafe-inline'",  # its <style> and a few style attributes (the queue bars)
            "connect-src 'self'",
            "img-src 'self' data:",
            "base-uri 'none'",
            "form-action 'none'",
            "frame-ancestors 'none'",
        ]
    )
    return {
        "Content-Security-Policy": policy,
        "X-Content-Type-Options": "nosniff",
        "X-Frame-Options": "DENY",
        "Referrer-Policy": "no-referrer",
    }
