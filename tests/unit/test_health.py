"""A stage replica's health from its reports: thresholds, cool-down, probe (pure; the clock is passed in)."""

import json

from app.core.config import Settings
from app.core.health import Cause, Health, Report, State, Thresholds, crossed, judge, not_healthy, record

LIMITS = Thresholds(
    max_temperature_c=85.0, max_memory_fraction=0.95, max_redis_rtt_ms=250.0, cooldown_s=30.0, fresh_s=10.0
)


def ok(at: float) -> Report:
    return Report(at=at, redis_rtt_ms=1.0, temperature_c=60.0, memory_fraction=0.5)


def test_each_threshold_trips_on_its_own_and_names_itself():
    assert crossed(ok(0.0), LIMITS) is None
    assert crossed(Report(at=0.0, temperature_c=86.0), LIMITS)[0] == Cause.TEMPERATURE  # type: ignore[index]
    assert crossed(Report(at=0.0, memory_fraction=0.96), LIMITS)[0] == Cause.MEMORY  # type: ignore[index]
    cause, detail = crossed(Report(at=0.0, redis_rtt_ms=300.0), LIMITS)  # type: ignore[misc]
    assert cause == Cause.REDIS_RTT and detail == "Redis round trip 300 ms, over 250 ms"
    # At the threshold is still healthy; a CPU reports no temperature or memory, only the round trip.
    assert (
        crossed(Report(at=0.0, redis_rtt_ms=250.0, temperature_c=85.0, memory_fraction=0.95), LIMITS) is None
    )


def test_a_report_over_a_threshold_makes_a_healthy_replica_unhealthy():
    hot = Report(at=100.0, redis_rtt_ms=1.0, temperature_c=91.0, memory_fraction=0.5)
    health = judge(Health(), hot, LIMITS, now=100.0)
    assert health.state == State.UNHEALTHY and health.cause == Cause.TEMPERATURE and health.since == 100.0
    assert not health.takes_new_batches
    assert judge(Health(), ok(100.0), LIMITS, now=100.0) == Health()  # under every threshold: no change


def test_the_cool_down_holds_whatever_the_reports_then_a_probe_and_one_more_report():
    sick = Health(State.UNHEALTHY, 100.0, Cause.MEMORY, "…")
    assert judge(sick, ok(110.0), LIMITS, now=110.0) == sick  # cooling down: a good report waits
    probing = judge(sick, ok(130.0), LIMITS, now=130.0)  # cool-down over, the probe passes
    assert probing.state == State.PROBING and probing.takes_new_batches and probing.cause is None
    assert judge(probing, ok(130.0), LIMITS, now=130.5) == probing  # the same report twice proves nothing
    assert judge(probing, ok(132.0), LIMITS, now=132.0).state == State.HEALTHY


def test_a_failed_probe_starts_another_cool_down():
    sick = Health(State.UNHEALTHY, 100.0, Cause.REDIS_RTT, "…")
    slow = Report(at=131.0, redis_rtt_ms=400.0)
    again = judge(sick, slow, LIMITS, now=131.0)
    assert again.state == State.UNHEALTHY and again.since == 131.0 and again.cause == Cause.REDIS_RTT
    assert judge(again, ok(150.0), LIMITS, now=150.0) == again  # 19 s into the new cool-down
    probing = judge(Health(State.UNHEALTHY, 100.0, Cause.REDIS_RTT), ok(131.0), LIMITS, now=131.0)
    hot = Report(at=133.0, temperature_c=90.0)
    assert judge(probing, hot, LIMITS, now=133.0).state == State.UNHEALTHY  # on probation: one crossing


def test_a_stale_or_missing_report_neither_trips_nor_ends_a_cool_down():
    hot_but_old = Report(at=100.0, temperature_c=99.0)
    assert judge(Health(), hot_but_old, LIMITS, now=111.0) == Health()
    sick = Health(State.UNHEALTHY, 100.0, Cause.TEMPERATURE)
    assert judge(sick, ok(120.0), LIMITS, now=140.0) == sick  # the cool-down is over, the report is stale
    assert judge(sick, None, LIMITS, now=140.0) == sick


def test_the_thresholds_are_fixed_and_freshness_follows_the_heartbeat():
    limits = Thresholds.from_settings(Settings())
    assert (limits.max_temperature_c, limits.max_memory_fraction, limits.max_redis_rtt_ms) == (
        85.0,
        0.95,
        250.0,
    )
    assert limits.cooldown_s == 30.0 and limits.fresh_s == Settings().heartbeat_ttl_s


def test_device_stats_become_a_report():
    stats = {"memory_used_mib": 950.0, "memory_total_mib": 1000.0, "temperature_c": 70}
    report = Report.from_device(stats, redis_rtt_ms=2.0, at=5.0)
    assert report.memory_fraction == 0.95 and report.temperature_c == 70 and report.redis_rtt_ms == 2.0
    cpu = Report.from_device(None, redis_rtt_ms=2.0, at=5.0)
    assert cpu.memory_fraction is None and cpu.temperature_c is None


def test_readers_see_only_fresh_records_of_replicas_not_healthy():
    hot = Report(at=100.0, temperature_c=90.0)
    sick = judge(Health(), hot, LIMITS, now=100.0)
    entries = {
        b"w-hot": record(sick, hot, model="m", stage=1),
        b"w-ok": record(Health(), ok(100.0), model="m", stage=1),
        b"w-gone": record(sick, Report(at=50.0, temperature_c=90.0), model="m", stage=0),
    }
    seen = not_healthy(entries, now=105.0, fresh_s=10.0)
    assert list(seen) == ["w-hot"]
    assert seen["w-hot"]["reason"] == "temperature" and seen["w-hot"]["stage"] == 1
    assert seen["w-hot"]["detail"] == "device at 90 C, over 85 C"
    assert json.loads(entries[b"w-ok"])["state"] == "healthy"
