"""Health of one stage replica, judged from its own reports: the rule, and the record readers share.

Each stage worker reports at every heartbeat (app/workers/heartbeat.py) its device's temperature and
memory use (a GPU; nothing on the CPU) and how long its Redis round trip took. Past a threshold the
replica is unhealthy and takes no new batches (app/workers/health.py says how), until a cool-down
has passed and a fresh report is under every threshold:

    healthy --(a report crosses a threshold)--> unhealthy
    unhealthy --(cool-down not over)--> unhealthy, whatever the reports say
    unhealthy --(cool-down over, a fresh report under every threshold: the probe)--> probing
    unhealthy --(cool-down over, the report still crosses one)--> unhealthy, for another cool-down
    probing --(the next fresh report under every threshold)--> healthy
    probing --(a report crosses a threshold)--> unhealthy, for another cool-down

A probing replica takes new batches again (as the breaker's half-open state admits a probe job);
one report later it is healthy, or back to unhealthy at the first crossing. `judge` is pure (the
clock is passed in), so the whole table is unit-tested without a device.

Who writes what: the worker writes its record (`record`) into the `health` hash at every beat; the
api's /readyz reads the hash and names each replica that is not healthy, and why.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

from app.core.config import Settings


class State(enum.StrEnum):
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"
    PROBING = "probing"


class Cause(enum.StrEnum):
    """Why a replica is unhealthy: the `reason` label of conveyor_stage_unhealthy."""

    TEMPERATURE = "temperature"
    MEMORY = "memory"
    REDIS_RTT = "redis_rtt"


@dataclass(frozen=True)
class Thresholds:
    """A device hotter or fuller than these (or a Redis round trip slower) makes its replica
    unhealthy; it comes back a cool-down later once a fresh report is under every threshold."""

    max_temperature_c: float = 85.0  # where GPUs start to throttle (the DeviceTemperatureHigh alert)
    max_memory_fraction: float = 0.95  # past it the next batch may not fit
    # 250 ms is a hundred times a healthy round trip in one zone: a network problem every hop pays.
    max_redis_rtt_ms: float = 250.0
    cooldown_s: float = 30.0  # as the breaker's interval: a throttled GPU cools
    fresh_s: float = 10.0  # a report older than this proves nothing (the heartbeat's TTL)

    @classmethod
    def from_settings(cls, settings: Settings) -> Thresholds:
        return cls(fresh_s=settings.heartbeat_ttl_s)


@dataclass(frozen=True)
class Report:
    """One heartbeat's measurements; None: not measured (a CPU has no temperature to report)."""

    at: float  # unix seconds
    redis_rtt_ms: float | None = None
    temperature_c: float | None = None
    memory_fraction: float | None = None  # device memory in use / device memory

    @classmethod
    def from_device(cls, stats: dict[str, Any] | None, *, redis_rtt_ms: float, at: float) -> Report:
        """From `app.workers.device.device_stats` (None on the CPU) and a timed round trip."""
        stats = stats or {}
        total = stats.get("memory_total_mib")
        return cls(
            at=at,
            redis_rtt_ms=redis_rtt_ms,
            temperature_c=stats.get("temperature_c"),
            memory_fraction=stats["memory_used_mib"] / total if total else None,
        )


@dataclass(frozen=True)
class Health:
    state: State = State.HEALTHY
    since: float | None = None  # when it entered this state (unhealthy: the cool-down starts here)
    cause: Cause | None = None  # unhealthy: the threshold crossed
    detail: str = ""  # unhealthy: the measurement, for a person

    @property
    def takes_new_batches(self) -> bool:
        return self.state != State.UNHEALTHY


def crossed(report: Report, limits: Thresholds) -> tuple[Cause, str] | None:
    """The first threshold the report crosses, and a sentence saying by how much; None: all under."""
    if report.temperature_c is not None and report.temperature_c > limits.max_temperature_c:
        return Cause.TEMPERATURE, f"device at {report.temperature_c:g} C, over {limits.max_temperature_c:g} C"
    if report.memory_fraction is not None and report.memory_fraction > limits.max_memory_fraction:
        return Cause.MEMORY, (
            f"device memory {report.memory_fraction:.1%} in use, over {limits.max_memory_fraction:.0%}"
        )
    if report.redis_rtt_ms is not None and report.redis_rtt_ms > limits.max_redis_rtt_ms:
        return Cause.REDIS_RTT, (
            f"Redis round trip {report.redis_rtt_ms:.0f} ms, over {limits.max_redis_rtt_ms:g} ms"
        )
    return None


def judge(previous: Health, report: Report | None, limits: Thresholds, now: float) -> Health:
    """The replica's health after `report` (None or stale: nothing new was measured), at `now`."""
    if previous.state == State.UNHEALTHY and now - (previous.since or now) < limits.cooldown_s:
        return previous  # cooling down: reports wait for the cool-down's end
    if report is None or now - report.at > limits.fresh_s:
        return previous  # nothing new: a stale report neither trips nor ends a cool-down
    breach = crossed(report, limits)
    if breach is not None:  # tripped, or a failed probe: a (new) cool-down starts now
        return Health(State.UNHEALTHY, now, *breach)
    if previous.state == State.UNHEALTHY:
        return Health(State.PROBING, now)  # the probe passed: new batches again, on probation
    if previous.state == State.PROBING and report.at > (previous.since or 0.0):
        return Health(State.HEALTHY, now)  # a second fresh report under every threshold
    return previous


# --- the record in Redis (hash `Keys.health`, one field per worker) ------------------------------


def record(health: Health, report: Report, *, model: str, stage: int) -> str:
    """The JSON a worker writes at each beat; `at` says how fresh it is."""
    return json.dumps(
        {
            "model": model,
            "stage": stage,
            "state": str(health.state),
            "since": health.since,
            "reason": str(health.cause) if health.cause else None,
            "detail": health.detail,
            "at": report.at,
            "redis_rtt_ms": report.redis_rtt_ms,
            "temperature_c": report.temperature_c,
            "memory_fraction": report.memory_fraction,
        }
    )


def not_healthy(entries: dict[Any, Any], now: float, fresh_s: float) -> dict[str, dict[str, Any]]:
    """The replicas of a `health` hash (HGETALL) whose fresh record is not healthy, by worker; a
    record older than `fresh_s` belongs to a replica that is gone (or not beating: not live)."""
    out: dict[str, dict[str, Any]] = {}
    for worker, raw in entries.items():
        entry = json.loads(raw)
        if now - float(entry.get("at", 0)) <= fresh_s and entry.get("state") != State.HEALTHY:
            out[worker.decode() if isinstance(worker, bytes) else str(worker)] = entry
    return out
