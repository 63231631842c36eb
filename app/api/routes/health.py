"""Liveness and readiness: /health (as vLLM and TGI answer it), /healthz and /readyz."""

from __future__ import annotations

import json
import time

from fastapi import APIRouter, Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response

from app.api.deps import get_jobs, get_settings
from app.api.schemas import Health
from app.api.service import JobService
from app.core.breaker import Action, decide
from app.core.config import EMBEDDING_MODEL, Settings
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
    per priority class, what each stage worker serves (layers, dtype, device), each GPU worker's
    device state, the stage replicas that are unhealthy (or probing) and why, and whether this
    process's event subscription is up."""
    redis = request.app.state.redis
    keys = Keys(settings.namespace)
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
        if devices:  # GPU workers: memory, utilisation and temperature (NVML), per worker
            checks["devices"] = devices
        served = {
            worker.decode(): info
            for worker, raw in (await redis.hgetall(keys.stage_info())).items()
            if now - (info := json.loads(raw)).pop("at", 0) <= settings.heartbeat_ttl_s
        }
        if served:  # what each live stage worker serves: model, layers, family, dtype, device
            checks["stages"] = served
        # Replicas that take no new batches (or have just come back), by worker: model, stage, state,
        # reason (temperature, memory, redis_rtt), detail, since. The other replicas serve meanwhile.
        sick = not_healthy(await redis.hgetall(keys.health()), now, settings.heartbeat_ttl_s)
        checks["health"] = {"not_healthy": sick}
        ready = all(n > 0 for m, s in live_per_model.items() if m not in problems for n in s.values())
    except Exception as exc:  # Redis down: not ready, and say why
        checks["redis"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        ready = False
    checks["events"] = {"subscribed": jobs.hub.subscribed}
    body = Health(status="ready" if ready else "not_ready", checks=checks)
    return JSONResponse(body.model_dump(), status_code=200 if ready else 503)


def _generation_models(settings: Settings) -> list[str]:
    """The default model first, then the other generation models `conveyor up` started."""
    others = [m for m in settings.served_models if m not in (settings.default_model, EMBEDDING_MODEL)]
    return [settings.default_model, *others]
