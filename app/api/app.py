"""The API app factory."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.concurrency import run_in_threadpool

from app.api import errors
from app.api.catalog import Catalog
from app.api.events import EventHub
from app.api.routes import embeddings, health, inference, jobs
from app.api.service import JobService
from app.core.config import Settings
from app.core.errors import ConveyorError
from app.core.keys import Keys
from app.core.redis import async_client
from app.workers.celery_app import create_celery_app

log = logging.getLogger(__name__)


def create_app(settings: Settings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        redis = async_client(settings.redis_url or "")
        hub = EventHub(redis, Keys(settings.namespace))
        catalog = Catalog(settings)
        try:
            await run_in_threadpool(catalog.get, settings.default_model)  # first request should not pay it
        except ConveyorError as exc:
            log.warning("default model not loaded: %s", exc.message)
        await hub.start()
        app.state.settings = settings
        app.state.redis = redis
        celery = create_celery_app(settings, settings.redis_url or "")
        app.state.jobs = JobService(settings, redis, catalog, hub, celery)
        try:
            yield
        finally:
            await hub.stop()
            await redis.aclose()

    app = FastAPI(
        title="Conveyor",
        summary="Message-queue driven asynchronous inference for large language models",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.settings = settings
    errors.install(app)
    app.include_router(jobs.router)
    app.include_router(inference.router)
    app.include_router(embeddings.router)
    app.include_router(health.router)
    return app
