"""Liveness and readiness."""

from __future__ import annotations

import json
import time

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from app.api.deps import get_jobs, get_settings
from app.api.schemas import Health
from app.api.service import JobService
from app.core.breaker import Action, decide
from app.core.config import Settings
from app.core.health import not_healthy
from app.core.keys import Keys

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
async def healthz() -> Health:
    """The process is alive."""
    return Health(status="ok")


@router.get("/readyz", response_model=Health, responses={503: {"model": Health}})
async def readyz(
    request: Request, settings: Settings = Depends(get_settings), jobs: JobService = Depends(get_jobs)
) -> JSONResponse:
    """Redis answers, and every stage of the default model's pipeline has a live worker.

    Also shown, without deciding readiness: the default model's circuit breaker, the jobs waiting
    per priority class, each GPU worker's device state, the stage replicas that are unhealthy (or
    probing) and why, and whether this process's event subscription is up."""
    redis = request.app.state.redis
    keys = Keys(settings.namespace)
    checks: dict[str, object] = {}
    try:
        started = time.perf_counter()
        await redis.ping()
        checks["redis"] = {"ok": True, "latency_ms": round((time.perf_counter() - started) * 1000, 2)}
        now = time.time()
        stages = {}
        for stage in range(settings.stages):
            live = await redis.zrangebyscore(
                keys.workers(settings.default_model, stage), now - settings.heartbeat_ttl_s, "+inf"
            )
            stages[str(stage)] = len(live)
        checks["workers"] = {"model": settings.default_model, "live_per_stage": stages}
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
        # Replicas that take no new batches (or have just come back), by worker: model, stage, state,
        # reason (temperature, memory, redis_rtt), detail, since. The other replicas serve meanwhile.
        sick = not_healthy(await redis.hgetall(keys.health()), now, settings.heartbeat_ttl_s)
        checks["health"] = {"not_healthy": sick}
        ready = all(n > 0 for n in stages.values())
    except Exception as exc:  # Redis down: not ready, and say why
        checks["redis"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        ready = False
    checks["events"] = {"subscribed": jobs.hub.subscribed}
    body = Health(status="ready" if ready else "not_ready", checks=checks)
    return JSONResponse(body.model_dump(), status_code=200 if ready else 503)
