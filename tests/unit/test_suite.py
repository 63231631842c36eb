"""The benchmark suite's pure parts: schedules, output lengths, job figures, and the target verdicts.

No server and no model: the prompts come from tiny.py's byte-level tokenizer, the runs are hand-made.
"""

import statistics
import sys
from pathlib import Path

import pytest
from tiny import make_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/ is not an installed package

from bench.load import (  # noqa: E402
    OUTPUT_TOKENS,
    JobResult,
    Run,
    burst_arrivals,
    offered_tokens_per_s,
    output_lengths,
    poisson_arrivals,
)
from bench.prompts import make_prompts  # noqa: E402
from bench.report import (  # noqa: E402
    itl_s,
    job_figures,
    job_rows,
    queue_waits,
    target_rows,
    unfinished_waits,
    wait_stats,
)
from bench.suite import CONVEYOR_1, CONVEYOR_2, NAIVE, RAY, TARGETS, cdf_points, ratios  # noqa: E402

# bench/'s own tests: `make test-bench`, out of the default gate
pytestmark = pytest.mark.bench

PROMPTS = make_prompts(make_tokenizer(), 16)


# ---------------------------------------------------------------- schedules and lengths


def test_poisson_schedule_has_the_asked_rate_and_is_seeded():
    offsets = poisson_arrivals(2.0, 2000.0, seed=7)
    assert offsets == poisson_arrivals(2.0, 2000.0, seed=7)
    assert offsets != poisson_arrivals(2.0, 2000.0, seed=8)
    assert abs(len(offsets) / 2000.0 - 2.0) < 0.1
    gaps = [b - a for a, b in zip(offsets, offsets[1:], strict=False)]
    assert abs(statistics.fmean(gaps) - 0.5) < 0.03
    assert abs(statistics.pstdev(gaps) - 0.5) < 0.05  # exponential gaps: sd = mean


def test_burst_steps_the_rate_up_tenfold_and_back():
    offsets = burst_arrivals(1.0, factor=10.0, before_s=500.0, burst_s=500.0, after_s=500.0, seed=3)
    assert offsets == sorted(offsets) and 0.0 <= offsets[0] and offsets[-1] < 1500.0
    before = sum(1 for t in offsets if t < 500.0)
    during = sum(1 for t in offsets if 500.0 <= t < 1000.0)
    after = sum(1 for t in offsets if t >= 1000.0)
    assert abs(before / 500.0 - 1.0) < 0.15 and abs(after / 500.0 - 1.0) < 0.15
    assert 8.5 < during / before < 11.5
    assert offsets == burst_arrivals(1.0, factor=10.0, before_s=500.0, burst_s=500.0, after_s=500.0, seed=3)
    assert offsets != burst_arrivals(1.0, factor=10.0, before_s=500.0, burst_s=500.0, after_s=500.0, seed=4)
    assert burst_arrivals(0.0, factor=10.0, before_s=1.0, burst_s=1.0, after_s=1.0, seed=1) == []


def test_output_lengths_spread_over_their_bounds_from_a_seed():
    lengths = output_lengths(2000, seed=11)
    low, high = OUTPUT_TOKENS
    assert lengths == output_lengths(2000, seed=11) and lengths != output_lengths(2000, seed=12)
    assert output_lengths(100, seed=11) == lengths[:100]  # a shorter run is a prefix
    assert all(low <= n <= high for n in lengths)
    assert 56 <= statistics.median(lengths) <= 72  # the lognormal's median, 64
    assert 0.01 < sum(n == high for n in lengths) / 2000 < 0.05  # a long tail, clipped
    assert sum(n == low for n in lengths) / 2000 < 0.05
    assert statistics.fmean(lengths) > statistics.median(lengths)  # skewed right
    assert len(set(lengths)) > 150


def test_prompt_lengths_spread_and_are_reproducible():
    lengths = [len(p.ids) for p in PROMPTS]
    assert PROMPTS == make_prompts(make_tokenizer(), 16)
    assert max(lengths) > 2 * min(lengths)


def test_offered_load_is_the_tokens_asked_per_second_of_the_window():
    assert offered_tokens_per_s([64, 16, 100], 10.0) == 18.0
    assert offered_tokens_per_s([64], 0.0) == 0.0


# ---------------------------------------------------------------- job figures


def timed(
    index: int, submitted: float, latency: float, *, ok=True, refused=False, tokens=10, ttft=None, wait=None
):
    error = None if ok else "boom"
    job = JobResult(
        index, ok, latency, ttft, tokens if ok else 0, error, refused=refused, cls="s", submitted=submitted
    )
    if wait is not None:
        job.phases_s = {"intake": wait / 4, "handoff": wait * 3 / 4}
    return job


def test_job_figures_count_unfinished_at_their_wait_and_span_first_arrival_to_last_end():
    prompts = PROMPTS[:5]
    start = 100.0
    run = Run(
        "s",
        offsets=[0.0, 1.0, 2.0, 3.0, 4.0],
        prompts=prompts,
        jobs=[
            timed(0, 100.0, 2.0, ttft=0.5),
            timed(1, 101.0, 4.0, ttft=1.0),
            timed(2, 102.0, 0.1, ok=False, refused=True),
            timed(3, 103.0, 0.2, ok=False),
        ],
        start=start,
        end=120.0,
    )
    assert unfinished_waits(run) == [16.0]  # prompt 4, submitted at 104, given up at 120
    f = job_figures(run)
    assert (f["jobs"], f["ok"], f["refused"], f["failed"], f["unfinished"]) == (5, 2, 1, 1, 1)
    assert f["tokens"] == 20 and f["span_s"] == 5.0 and f["tokens_per_s"] == 4.0  # 100 -> 105
    assert f["latency_p99_s"] < 4.0 < f["latency_p99_all_s"] <= 16.0
    assert f["itl_p50_s"] is not None and f["waited_s"] == 20.0
    rows = job_rows(run)  # every job for the JSON, the unfinished one too, at its submit time
    assert [(r["prompt"], r["status"]) for r in rows] == [
        (0, "succeeded"),
        (1, "succeeded"),
        (2, "refused"),
        (3, "failed"),
        (4, "unfinished"),
    ]
    assert rows[1]["submitted_s"] == 1.0 and rows[4]["submitted_s"] == 4.0 and rows[0]["class"] == "s"


def test_itl_is_the_mean_gap_after_the_first_token_and_none_unstreamed():
    assert itl_s(JobResult(0, True, 2.1, 0.1, 11)) == 0.2
    assert itl_s(JobResult(0, True, 2.0, 2.0, 11)) is None  # the whole answer at once
    assert itl_s(JobResult(0, True, 2.0, 0.1, 1)) is None
    assert itl_s(JobResult(0, False, 2.0, 0.1, 11)) is None


def test_queue_waits_by_submit_time_and_their_window_stats():
    run = Run(
        "s",
        offsets=[0.0, 1.0, 2.0],
        prompts=PROMPTS[:3],
        jobs=[timed(0, 10.0, 1.0, wait=0.02), timed(1, 11.0, 1.0, wait=0.04), timed(2, 12.5, 1.0)],
        start=10.0,
        end=20.0,
    )
    waits = queue_waits(run)
    assert waits == [(0.0, 0.02), (1.0, 0.04)]  # a job without timings has no queue wait
    assert wait_stats(waits, 0.0, 1.0) == {"jobs": 1, "median_s": 0.02, "p95_s": 0.02}
    assert wait_stats(waits, 5.0, 9.0) == {"jobs": 0, "median_s": None, "p95_s": None}


def test_cdf_is_a_fraction_of_the_submitted_jobs():
    xs, ys = cdf_points([3.0, 1.0], 4)
    assert xs == [1.0, 3.0] and ys == [0.25, 0.5]


# ---------------------------------------------------------------- ratios and verdicts


def point(tokens_per_s: float, p99: float) -> dict:
    return {"tokens_per_s": tokens_per_s, "latency_p99_all_s": p99}


def results(conveyor_p99: float = 20.0, high_during: float = 0.06) -> dict:
    return {
        "raw": {"raw generate b32": {"tokens_per_s": 100.0}, "raw generate b64": {"tokens_per_s": 125.0}},
        "systems": {
            NAIVE: {"points": {"1.0": point(17.0, 60.0)}},
            RAY: {"points": {"1.0": point(50.0, 30.0)}},
            CONVEYOR_1: {
                "points": {"1.0": point(68.0, conveyor_p99)},
                "peak": {"tokens_per_s": 110.0},
                "burst": {
                    "high": {
                        "before": {"p95_s": 0.05},
                        "during": {"p95_s": high_during},
                        "counts": {"failed": 0, "unfinished": 0},
                    },
                    "normal": {"counts": {"failed": 0, "unfinished": 1}},
                },
            },
            CONVEYOR_2: {"error": "did not start"},
        },
    }


def test_ratios_against_the_naive_server_ray_and_the_raw_limit():
    r = ratios(results(), 1.0)
    assert r[f"{CONVEYOR_1}: throughput vs naive"] == 4.0
    assert abs(r[f"{CONVEYOR_1}: p99 vs naive"] - 1 / 3) < 1e-9
    assert r[f"{CONVEYOR_1}: throughput vs ray"] == 1.36
    assert abs(r[f"{CONVEYOR_1}: p99 vs ray"] - 2 / 3) < 1e-9
    assert r["peak vs raw"] == 110.0 / 125.0  # against the better raw batch size
    assert abs(r["burst high p95 wait"] - 1.2) < 1e-9
    assert r["burst lost jobs"] == 1.0
    assert r[f"{CONVEYOR_2}: throughput vs naive"] is None  # not measured: no figure, no verdict
    assert ratios({"systems": {}}, 1.0)["peak vs raw"] is None


def test_target_rows_give_a_verdict_each():
    rows = target_rows(TARGETS, ratios(results(conveyor_p99=40.0, high_during=0.1), 1.0))
    assert len(rows) == 2 + len(TARGETS)
    by_label = {row.split(" | ")[0].removeprefix("| "): row for row in rows[2:]}
    assert by_label[f"{CONVEYOR_1} / naive server throughput"].endswith("| met |")
    assert by_label[f"{CONVEYOR_1} / naive server P99 latency"].endswith("| missed |")  # 0.67 > 0.58
    assert by_label[f"{CONVEYOR_1} / Ray Serve P99 latency"].endswith("| missed |")  # 1.33 > 0.8
    assert by_label["burst: high P95 queue wait, during / before"].endswith("| missed |")  # 2x
    assert by_label["burst: accepted jobs lost (failed or unfinished)"].endswith("| missed |")
    assert by_label[f"{CONVEYOR_2} / Ray Serve throughput"].endswith("| n/a | >= 1.2x | n/a |")


def test_each_system_runs_its_rates_and_conveyor_1_stage_also_the_burst_and_the_peak():
    from bench.suite import FULL, QUICK, phases_of

    assert phases_of(NAIVE, QUICK) == [("rate", r) for r in QUICK.rates]
    assert phases_of(CONVEYOR_2, QUICK) == [("rate", QUICK.main_rate)]
    assert [k for k, _ in phases_of(CONVEYOR_1, QUICK)][-2:] == ["burst", "peak"]
    assert phases_of(CONVEYOR_2, FULL) == phases_of(RAY, FULL)
    for plan in (QUICK, FULL):
        assert plan.main_rate in plan.rates and list(plan.rates) == sorted(plan.rates)


def test_rates_narrow_the_sweep_but_keep_the_comparison_point():
    import argparse

    import pytest

    from bench.suite import FULL, QUICK, rates_arg, with_rates

    assert rates_arg("1, 0.5,0.75,0.5") == (0.5, 0.75, 1.0)
    for bad in ("fast", "0,1", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            rates_arg(bad)
    narrow = with_rates(FULL, (0.5, 0.75, 1.0))
    assert narrow.rates == narrow.second_layout_rates == (0.5, 0.75, 1.0)
    assert narrow.window_s == FULL.window_s  # only the sweep changes
    assert with_rates(QUICK, (0.5, 0.75, 1.0)).second_layout_rates == (1.0,)
    assert with_rates(FULL, None) is FULL
    with pytest.raises(ValueError, match="comparison point"):
        with_rates(FULL, (0.5, 0.75))
