"""Liveness and readiness: /health (as vLLM and TGI answer it), /healthz and /readyz."""

from __future__ import annotations

import json
import time

from fastapi import APIRouter, Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response
from redis.exceptions import RedisError

from app.api.auth import ANONYMOUS
from app.api.deps import get_jobs, get_settings
from app.api.schemas import Health
from app.api.service import JobService
from app.core.breaker import Action, decide
from app.core.config import Settings
from app.core.discovery import GENERATION, kind_of
from app.core.errors import ConveyorError
from app.core.health import not_healthy
from app.core.keys import Keys

router = APIRouter(tags=["health"])


@router.get(
    "/health",
    response_class=Response,
    responses={200: {"description": "The API process is up. An empty body."}},
)
async def health() -> Response:
    """The process is alive: 200 with an empty body, as vLLM and TGI answer it, for the load balancers
    and benchmark tools that probe `/health`. Says nothing of Redis or workers (that is /readyz)."""
    return Response(status_code=200)


@router.get("/healthz", response_model=Health)
async def healthz() -> Health:
    """The process is alive."""
    return Health(status="ok")


@router.get("/readyz", response_model=Health, responses={503: {"model": Health}})
async def readyz(
    request: Request, settings: Settings = Depends(get_settings), jobs: JobService = Depends(get_jobs)
) -> JSONResponse:
    """Redis answers, and every stage of the default model's pipeline (of every generation model
    `conveyor up` serves) has a live worker.

    Also shown, without deciding readiness: the default model's circuit breaker, the jobs waiting
    per priority class, how many stage replicas are unhealthy (or probing), and whether this
    process's event subscription is up. To a caller whose credentials name a tenant of
    `CONVEYOR_ADMIN_TENANTS` only (the probe answers anyone, and worker names are host names): what
    each stage worker serves (layers, dtype, device), each GPU worker's device state, which replicas
    are unhealthy and why, and the error of a Redis that does not answer.

    Under `CONVEYOR_SUBMIT_DURABILITY=fsync`, also whether Redis can keep a submit on disk now (it is
    asked again every few seconds): while it cannot, submits are refused and the API is not ready."""
    redis = request.app.state.redis
    keys = Keys(settings.namespace)
    admin = await _is_admin(request, settings)
    checks: dict[str, object] = {}
    try:
        started = time.perf_counter()
        await redis.ping()
        checks["redis"] = {"ok": True, "latency_ms": round((time.perf_counter() - started) * 1000, 2)}
        now = time.time()
        live_per_model = {}
        models = _generation_models(settings)
        # A served model the stages cannot serve has no workers to wait for (they refused it).
        problems = {m: p for m in models if (p := await run_in_threadpool(jobs.catalog.problem, m))}
        if problems:
            checks["unservable"] = problems
        for model in models:
            stages = {}
            for stage in range(settings.stages):
                live = await redis.zcount(keys.workers(model, stage), now - settings.heartbeat_ttl_s, "+inf")
                stages[str(stage)] = int(live)
            live_per_model[model] = stages
        stages = live_per_model[settings.default_model]
        checks["workers"] = {"model": settings.default_model, "live_per_stage": stages}
        if len(live_per_model) > 1:  # `conveyor up --model A --model B`: every pipeline counts
            checks["models"] = {model: {"live_per_stage": s} for model, s in live_per_model.items()}
        breaker = jobs.admission.breaker
        snap = await breaker.snapshot(settings.default_model, now)
        ok, failed = snap.counted(now, breaker.policy.interval_s)
        verdict = decide(snap, breaker.policy, now)
        checks["breaker"] = {
            "model": settings.default_model,
            "state": str(snap.state),
            "admitting": verdict.action not in (Action.REFUSE, Action.TRIP),
            "succeeded": ok,
            "failed": failed,
            "interval_s": breaker.policy.interval_s,
        }
        checks["queues"] = await jobs.admission.depths()
        devices = {
            worker.decode(): stats
            for worker, raw in (await redis.hgetall(keys.devices())).items()
            if now - (stats := json.loads(raw)).get("at", 0) <= settings.heartbeat_ttl_s
        }
        if devices and admin:  # GPU workers: memory, utilisation and temperature (NVML), per worker
            checks["devices"] = devices
        served = {
            worker.decode(): info
            for worker, raw in (await redis.hgetall(keys.stage_info())).items()
            if now - (info := json.loads(raw)).pop("at", 0) <= settings.heartbeat_ttl_s
        }
        if served and admin:  # what each live stage worker serves: model, layers, family, dtype, device
            checks["stages"] = served
        # Replicas that take no new batches (or have just come back), by worker: model, stage, state,
        # reason (temperature, memory, redis_rtt), detail, since. The other replicas serve meanwhile.
        sick = not_healthy(await redis.hgetall(keys.health()), now, settings.heartbeat_ttl_s)
        checks["health"] = {"unhealthy_replicas": len(sick), **({"not_healthy": sick} if admin else {})}
        ready = all(n > 0 for m, s in live_per_model.items() if m not in problems for n in s.values())
        if jobs.admission.fsync is not None:  # CONVEYOR_SUBMIT_DURABILITY=fsync: can Redis give it now?
            problem = await jobs.admission.fsync.problem()
            checks["durability"] = {"fsync": problem is None, **({"problem": problem} if problem else {})}
            ready = ready and problem is None
    except Exception as exc:  # Redis down: not ready, and say why (its address only to an admin)
        checks["redis"] = {
            "ok": False,
            "error": f"{type(exc).__name__}: {exc}" if admin else type(exc).__name__,
        }
        ready = False
    checks["events"] = {"subscribed": jobs.hub.subscribed}
    body = Health(status="ready" if ready else "not_ready", checks=checks)
    return JSONResponse(body.model_dump(), status_code=200 if ready else 503)


async def _is_admin(request: Request, settings: Settings) -> bool:
    """The caller's credentials name a tenant of `admin_tenants` (under CONVEYOR_AUTH=none every caller
    is `anonymous`). A probe without credentials is not authenticated at all: nothing is counted."""
    if not settings.admin_tenants:
        return False
    auth = request.app.state.auth
    if auth.open:
        return ANONYMOUS in settings.admin_tenants
    if not (request.headers.get("authorization") or request.headers.get("x-api-key")):
        return False
    try:
        principal = await auth.authenticate(request.headers)
    except (ConveyorError, RedisError):  # a bad credential, or Redis down: the answer anyone gets
        return False
    return principal.tenant in settings.admin_tenants


def _generation_models(settings: Settings) -> list[str]:
    """The default model first, then the other generation models `conveyor up` started."""
    others = [m for m in settings.served_models if m != settings.default_model and kind_of(m) == GENERATION]
    return [settings.default_model, *others]
