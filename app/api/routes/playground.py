"""The playground: one static page (app/api/static/playground.html) where a person tries the API.

It needs no credentials to load; the requests it makes carry the API key typed into it, so it
works with auth on or off. No build step: the page is plain HTML with inline JS and CSS.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, RedirectResponse

PAGE = Path(__file__).resolve().parent.parent / "static" / "playground.html"

router = APIRouter(tags=["playground"], include_in_schema=False)


@router.get("/")
async def root() -> RedirectResponse:
    """A browser pointed at the API lands on the playground."""
    return RedirectResponse("/playground", status_code=307)


@router.get("/playground")
async def playground() -> FileResponse:
    return FileResponse(PAGE, media_type="text/html; charset=utf-8")
