"""The API app factory."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import redis.asyncio
from fastapi import Depends, FastAPI
from fastapi.concurrency import run_in_threadpool
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from app.api import errors
from app.api.audit import AuditMiddleware
from app.api.auth import Authenticator, authenticate
from app.api.authmode import start_recording, stop_recording
from app.api.batchfeed import BatchFeeder
from app.api.catalog import Catalog
from app.api.events import EventHub
from app.api.hosts import HostMiddleware
from app.api.limits import BodyLimitMiddleware
from app.api.metrics import MetricsMiddleware
from app.api.metrics import router as metrics_router
from app.api.routes import (
    batches,
    deliveries,
    embeddings,
    health,
    inference,
    jobs,
    openai,
    playground,
    tokenize,
    ws,
)
from app.api.service import JobService
from app.core.batchstore import BatchStore
from app.core.config import Settings
from app.core.durability import FsyncWatch, fsync_mode
from app.core.errors import ConveyorError
from app.core.heap import trim_heap_every
from app.core.keys import Keys
from app.core.known_secrets import refuse_known_secrets

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
    refuse_known_secrets(settings)  # a published example key, JWT secret or password: no API at all

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        redis = api_redis(settings.redis_url or "")
        keys = Keys(settings.namespace)
        # A bad JWT setting stops the start here.
        app.state.auth = Authenticator(settings.authenticator, redis, keys)
        await _warn_if_open(app.state.auth, redis, keys)
        hub = EventHub(redis, keys)
        catalog = Catalog(settings.catalog)
        catalog.routes()  # a route naming a model not served stops the start here, saying which
        try:
            await run_in_threadpool(catalog.get, settings.default_model)  # first request should not pay it
        except ConveyorError as exc:
            log.warning("default model not loaded: %s", exc.message)
        await hub.start()
        jobs: JobService | None = None
        recorder: asyncio.Task[None] | None = None
        feeder: BatchFeeder | None = None
        feeding: asyncio.Task[None] | None = None
        trimming = asyncio.create_task(trim_heap_every())  # the C heap's free pages back (app/core/heap.py)
        try:  # from here on, a start that fails stops the hub's listener too (it would outlive the app)
            app.state.settings = settings
            app.state.redis = redis
            jobs = app.state.jobs = JobService(settings.job_service, redis, catalog, hub)
            if settings.submit_durability == "fsync":  # a Redis that cannot give it stops the start here
                mode = await fsync_mode(redis)
                jobs.admission.fsync = FsyncWatch(redis, mode)  # and asked again while it runs
                log.info("submits are answered once on disk (%s)", mode)
            # How this API serves, for `conveyor keys create` to read (app/api/authmode.py).
            recorder = await start_recording(redis, keys, settings.auth)
            app.state.batches = BatchStore(redis, keys)  # Batch API
            feeder = BatchFeeder(settings, jobs, app.state.batches)
            feeding = asyncio.create_task(feeder.run())
            yield
        finally:
            trimming.cancel()
            if feeder is not None and feeding is not None:
                await feeder.stop(feeding)
            if recorder is not None:
                await stop_recording(recorder, redis, keys, settings.auth)
            if jobs is not None:
                jobs.prompts.close()
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
    # A batch input file has its own limit (and multipart's few hundred bytes around it).
    uploads = {"/v1/files": settings.batch.file_max_bytes + 64 * 1024}
    app.add_middleware(BodyLimitMiddleware, limit=settings.max_body_bytes, paths=uploads)
    # Another Host is refused before the body is read (DNS rebinding: app/api/hosts.py).
    app.add_middleware(HostMiddleware, allowed=settings.allowed_hosts)
    app.add_middleware(AuditMiddleware)  # outside the body limit, so it sees 401, 413 and 400 host too
    app.add_middleware(MetricsMiddleware)  # outermost: counts every answer, whoever gave it
    # Every route but health, metrics, the docs and the playground page needs credentials
    # (app/api/auth.py); the WebSocket route authenticates itself (a refusal there is a close code).
    protected = [Depends(authenticate)]
    app.include_router(jobs.router, dependencies=protected)
    app.include_router(deliveries.router, dependencies=protected)  # Webhooks: GET /v1/jobs/{id}/deliveries
    app.include_router(ws.router)
    app.include_router(inference.router, dependencies=protected)
    app.include_router(embeddings.router, dependencies=protected)
    app.include_router(openai.router, dependencies=protected)
    app.include_router(tokenize.router, dependencies=protected)
    app.include_router(batches.router, dependencies=protected)  # Batch API: /v1/files, /v1/batches
    app.include_router(health.router)
    app.include_router(metrics_router)
    app.include_router(playground.router)  # a static page; its requests carry the key typed into it
    return app


async def _warn_if_open(auth: Authenticator, client: redis.asyncio.Redis, keys: Keys) -> None:
    """The loud line an operator must not miss: this API is open to anyone who reaches it, or it
    refuses everyone because no credential exists yet; and the keys stored in Redis it does not check."""
    try:
        stored = await client.hlen(keys.api_keys())
    except RedisError:
        stored = 0  # unknown until Redis answers; every request looks again
    if auth.open:
        log.warning(
            "!!! NO AUTHENTICATION (CONVEYOR_AUTH=none): anyone who reaches this API is tenant "
            "'anonymous'%s. Set CONVEYOR_AUTH=keys and create a key with `conveyor keys create --tenant "
            "NAME` before exposing it beyond localhost. !!!",
            f"; the {stored} API keys stored in Redis are ignored" if stored else "",
        )
    elif not auth.configured and not (auth.redis_keys and stored):
        log.warning(
            "no API key and no JWT key is configured: every request is refused (401) until one exists. "
            "Create a key with `conveyor keys create --tenant NAME`, or serve without authentication "
            "with CONVEYOR_AUTH=none."
        )
    elif stored and not auth.redis_keys:
        log.warning(
            "the %d API keys stored in Redis are not checked: the keys in CONVEYOR_API_KEYS are the "
            "whole list",
            stored,
        )
