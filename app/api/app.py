"""The API app factory."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import redis.asyncio
from fastapi import FastAPI
from fastapi.concurrency import run_in_threadpool
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from app.api import errors
from app.api.catalog import Catalog
from app.api.events import EventHub
from app.api.routes import deliveries, embeddings, health, inference, jobs, openai, ws
from app.api.service import JobService
from app.core.config import Settings
from app.core.errors import ConveyorError
from app.core.keys import Keys
from app.workers.celery_app import create_celery_app

log = logging.getLogger(__name__)

# Requests wait up to POOL_WAIT_S for a free Redis connection rather than fail at once when a burst
# holds them all (redis-py's plain pool raises at its limit); past the wait, 503 unavailable.
REDIS_CONNECTIONS = 100
POOL_WAIT_S = 5.0


def api_redis(url: str) -> redis.asyncio.Redis:
    """The API's client. A command that meets a connection Redis closed (it restarted) is sent once
    more on a new one, so a restart costs no request an error; a Redis that stays away still
    answers at once (connection refused twice)."""
    pool = redis.asyncio.BlockingConnectionPool.from_url(
        url,
        max_connections=REDIS_CONNECTIONS,
        timeout=POOL_WAIT_S,
        health_check_interval=30,
        # Not on a timeout: the command may have run.
        retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
    )
    return redis.asyncio.Redis.from_pool(pool)


def create_app(settings: Settings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        redis = api_redis(settings.redis_url or "")
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
    app.include_router(deliveries.router)  # Webhooks: GET /v1/jobs/{id}/deliveries
    app.include_router(ws.router)
    app.include_router(inference.router)
    app.include_router(embeddings.router)
    app.include_router(openai.router)
    app.include_router(health.router)
    return app
