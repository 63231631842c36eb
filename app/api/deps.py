"""FastAPI dependencies: the process's settings and services, kept on `app.state` by the factory."""

from __future__ import annotations

from fastapi import Request

from app.api.service import JobService
from app.core.config import Settings


def get_settings(request: Request) -> Settings:
    return request.app.state.settings  # type: ignore[no-any-return]


def get_jobs(request: Request) -> JobService:
    return request.app.state.jobs  # type: ignore[no-any-return]
