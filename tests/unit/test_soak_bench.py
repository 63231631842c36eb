"""The soak's pure parts (bench/soak.py): arrivals, the traffic mix, slopes, process roles, the
traceback search and the report's verdict rows."""

from __future__ import annotations

import argparse
import random

import pytest

from bench import soak
from bench.load import poisson_arrivals
from bench.systems import Model

# bench/'s own tests: `make test-bench`, out of the default gate
pytestmark = pytest.mark.bench


def test_poisson_arrivals_come_at_the_asked_rate() -> None:
    times = poisson_arrivals(10.0, 600.0, seed=1)  # the soak's arrivals (bench.load's, as every benchmark's)
    assert times == sorted(times) and 0 < times[0] and times[-1] < 600
    assert len(times) == pytest.approx(6000, rel=0.05)


def test_the_mix_holds_its_shares() -> None:
    rng = random.Random(2)
    kinds = [soak.kind_of(rng, 0.05, 0.05) for _ in range(20_000)]
    assert kinds.count("cancel") / len(kinds) == pytest.approx(0.05, abs=0.01)
    assert kinds.count("poison") / len(kinds) == pytest.approx(0.05, abs=0.01)
    tenants = [soak.tenant_of(rng) for _ in range(20_000)]
    assert tenants.count("tenant-a") / len(tenants) == pytest.approx(2 / 3, abs=0.02)


def test_slope_per_hour() -> None:
    flat = [(t, 100.0) for t in range(0, 1800, 15)]
    growing = [(t, 100.0 + t / 60) for t in range(0, 1800, 15)]  # 1 MiB a minute
    assert soak.slope_per_hour(flat) == pytest.approx(0.0)
    assert soak.slope_per_hour(growing) == pytest.approx(60.0)
    assert soak.slope_per_hour(growing[:2]) is None


@pytest.mark.parametrize(
    ("cmdline", "role"),
    [
        ("/x/redis-server 127.0.0.1:6400", "redis"),
        ("/v/python -m app.cli worker --model tiny --stage 0 --stages 2", "stage worker"),
        ("/v/python -m app.cli worker --model all-MiniLM-L6-v2 --stage 1 --stages 2", "embeddings worker"),
        ("/v/python -m app.cli batcher", "batcher"),
        ("/v/python -m app.cli webhooks dispatcher", "webhooks dispatcher"),
        ("/v/python -m app.cli webhooks worker", "callbacks worker"),
        ("/v/python -m app.cli api", "api"),
        ("/v/python -m app.cli up", "supervisor"),
    ],
)
def test_each_process_is_named_by_its_role(cmdline: str, role: str) -> None:
    assert soak.role_of(cmdline) == role


def test_tracebacks_are_found_by_their_exception_line() -> None:
    log = "ok\nTraceback (most recent call last):\n  File \"x\", line 1\n    f()\nKeyError: 'b1'\nok\n"
    assert soak.tracebacks(log) == ["KeyError: 'b1'"]
    assert soak.tracebacks("all quiet\n") == []


def test_the_report_states_lost_stuck_and_each_slope() -> None:
    args = argparse.Namespace(
        model="tiny",
        minutes=30.0,
        load=0.7,
        calibrate_s=60.0,
        max_tokens=16,
        cancel=0.05,
        poison=0.05,
        ended_ttl_s=300,
        warmup_min=None,
        env=[],
    )
    tally = soak.Tally(accepted={"j1": "tenant-a", "j2": "tenant-b"}, lost=["j2"])
    tally.final["succeeded"] = 1
    tally.refused[422] = 3
    samples = soak.Samples(redis=[(t, 50.0) for t in range(0, 1800, 15)])
    samples.rss["stage worker 42"] = [(t, 400.0 + t / 3600) for t in range(0, 1800, 15)]
    text = soak.report(args, Model("tiny", soak.RESULTS_DIR), 10.0, 1900.0, tally, samples, ["KeyError: 'x'"])
    assert "| **lost** (accepted, then gone) | **1** |" in text
    assert "| **stuck** (not ended after the drain) | **0** |" in text
    assert "| poison refused | 422: 3 |" in text
    assert "| redis used_memory | 50.0 | 50.0 | +0.0 |" in text
    assert "| stage worker 42 |" in text and "+1.0 |" in text
    assert "Tracebacks: KeyError: 'x'" in text
    assert "after the 6-minute warm-up" in text  # a fifth of the run


def test_a_given_warm_up_sets_where_the_slopes_start() -> None:
    args = argparse.Namespace(
        model="tiny", minutes=30.0, load=0.7, calibrate_s=60.0, max_tokens=16, cancel=0.05, poison=0.05,
        ended_ttl_s=300, warmup_min=20.0, env=[],
    )  # fmt: skip
    samples = soak.Samples(redis=[(t, 50.0 if t < 1200 else 60.0) for t in range(0, 1800, 15)])
    text = soak.report(args, Model("tiny", soak.RESULTS_DIR), 10.0, 1900.0, soak.Tally(), samples, [])
    assert "--warmup-min 20`" in text and "after the 20-minute warm-up" in text
    assert "| redis used_memory | 60.0 | 60.0 | +0.0 |" in text  # the step before minute 20 is left out
