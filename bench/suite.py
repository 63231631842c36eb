"""The benchmark suite: Conveyor against a naive server and Ray Serve: same model, prompts, machine and run.

Systems (bench/suite_systems.py): the naive server (`model.generate` one request at a time), Ray Serve
(`@serve.batch` around `model.generate`, one replica of 2 CPUs), Conveyor with 1 stage and with 2
stages, and in-process `model.generate` at batch 32 and 64 (the raw limit). Every job asks for its own
number of tokens with EOS ignored, so every system does the same work: output lengths are a seeded
lognormal (median 64, clipped to 16-256), prompts bench.prompts' seeded chat requests.

1. Load sweep: open-loop Poisson arrivals at each rate (jobs/s) of the plan for `window_s`, the same
   seeded schedule and prompts on every system; each system gets `drain_cap_s` after the last arrival,
   then its unfinished jobs are counted (and enter the P99 at the time they had waited). A system that
   left jobs unfinished is started afresh for its next phase: the work it had queued would run on into
   it. The comparison point is `main_rate`: 1 job/s, about 87 tokens/s asked, five times what the naive
   server generates on 2 cores (about 17 tokens/s) and more than Ray Serve's request-level batches keep
   up with, at the edge of Conveyor's capacity. A throughput ratio at a load can be no more than that load
   over the slower system's capacity: at 0.75 jobs/s (70 tokens/s asked) that ceiling is about 4x, too
   close to the 3.8x target to tell the systems apart. Throughput: tokens of successful jobs / (first
   arrival to last completion).
2. Peak (Conveyor 1 stage): 64 closed-loop clients, 64 tokens a job; the token rate received over a
   window that opens once the ramp's prefills have drained (steady state), against raw `generate` at
   batch 32 and 64 (64 tokens, prefill included; the better of the two).
3. Burst (Conveyor 1 stage): `normal` jobs at a low rate that steps up 10x for a window and back, plus
   `high` jobs at a steady rate; the high jobs' queue wait (started_at - created_at, from each job's final
   record: the intake, the broker and the step in progress, until its prefill began) before and during
   the burst, and that no accepted job was lost.

    .venv/bin/python -m bench.suite [--quick | --smoke] [--model smollm2|tiny] [--systems "naive server,..."]
                                    [--rates 0.5,0.75,1] [--no-raw] [--results DIR]

--quick (what `make bench` runs) is under 10 minutes on 2 cores (shorter windows, 2 rates, the 2-stage
layout at the main rate only); the full plan (`make bench-full`) about an hour;
`--rates` narrows its sweep (three rates: about 45 minutes). `--smoke --model tiny`
runs the tests' tiny random Llama for seconds a phase: a check of the machinery, not a measurement.
Writes bench/results/suite.md, suite.json, suite_latency_cdf.png, suite_load.png and suite_burst.png.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import platform
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from bench.processes import say, terminate_on_sigterm
from bench.prompts import SEED, Prompt, make_prompts
from bench.report import RESULTS_DIR, git_commit, token_stats, write_results
from bench.scheduling_load import poisson_arrivals
from bench.scheduling_stack import Model, chosen_model
from bench.suite_load import (
    BURST_FACTOR,
    OUTPUT_MEDIAN,
    OUTPUT_SIGMA,
    OUTPUT_TOKENS,
    OpenRun,
    burst_arrivals,
    burst_run,
    job_figures,
    job_rows,
    offered_tokens_per_s,
    open_run,
    output_lengths,
    peak_run,
    queue_waits,
    sized,
    wait_stats,
)
from bench.suite_plots import plot_all
from bench.suite_report import markdown, payload
from bench.suite_systems import CONVEYOR_1, CONVEYOR_2, SYSTEMS, System, raw_limit, start, warm_up_plain

LENGTH_SEED = SEED + 10  # output lengths of the main prompt pool
ARRIVAL_SEED = SEED + 11  # the sweep's Poisson schedule (one stream, scaled by each rate)
HIGH_SEED = SEED + 12  # the burst's high prompts, lengths and arrivals
BURST_SEED = SEED + 13  # the burst's normal arrivals
PEAK_TOKENS = 64  # the peak and the raw limit: every job this long, as bench.slice's
RAW_BATCHES = (32, 64)


@dataclass(frozen=True)
class Plan:
    name: str
    rates: tuple[float, ...]  # jobs/s of the load sweep, ascending
    main_rate: float  # the comparison point (one of `rates`)
    window_s: float  # arrivals per rate
    drain_cap_s: float  # after the last arrival
    burst_drain_cap_s: float  # the burst's jobs are waited for longer: every accepted one should end
    burst_normal_rate: float  # jobs/s before and after the burst (x BURST_FACTOR during it)
    burst_high_rate: float
    burst_before_s: float
    burst_s: float
    burst_after_s: float
    peak_clients: int
    peak_ramp_s: float
    peak_warm_s: float  # after the ramp, before the window: the ramp's prefills drain
    peak_window_s: float
    raw_calls: int  # `generate` calls per raw batch size
    second_layout_rates: tuple[float, ...]  # the rates conveyor 2 stages runs (quick: the main one only)


FULL = Plan(
    "full",
    rates=(0.25, 0.5, 0.75, 1.0, 1.25),
    main_rate=1.0,
    window_s=120.0,
    drain_cap_s=60.0,
    burst_drain_cap_s=180.0,
    burst_normal_rate=0.12,
    burst_high_rate=0.5,
    burst_before_s=60.0,
    burst_s=60.0,
    burst_after_s=30.0,
    peak_clients=64,
    peak_ramp_s=30.0,
    peak_warm_s=30.0,
    peak_window_s=120.0,  # several of the closed loop's waves (jobs of one length end together)
    raw_calls=2,
    second_layout_rates=(0.25, 0.5, 0.75, 1.0, 1.25),
)
QUICK = Plan(
    "quick",
    rates=(0.5, 1.0),
    main_rate=1.0,
    window_s=20.0,
    drain_cap_s=20.0,
    burst_drain_cap_s=45.0,
    burst_normal_rate=0.12,
    burst_high_rate=0.5,
    burst_before_s=10.0,
    burst_s=10.0,
    burst_after_s=5.0,
    peak_clients=64,
    peak_ramp_s=10.0,
    peak_warm_s=20.0,
    peak_window_s=30.0,
    raw_calls=1,
    second_layout_rates=(1.0,),
)
SMOKE = Plan(  # seconds of each phase: the machinery end to end (with --model tiny), not a measurement
    "smoke",
    rates=(1.0, 2.0),
    main_rate=2.0,
    window_s=5.0,
    drain_cap_s=5.0,
    burst_drain_cap_s=10.0,
    burst_normal_rate=0.5,
    burst_high_rate=1.0,
    burst_before_s=3.0,
    burst_s=3.0,
    burst_after_s=2.0,
    peak_clients=8,
    peak_ramp_s=1.0,
    peak_warm_s=1.0,
    peak_window_s=3.0,
    raw_calls=1,
    second_layout_rates=(2.0,),
)


@dataclass(frozen=True)
class Workload:
    pool: list[Prompt]  # the sweep's prompts, distinct, enough for the busiest rate
    lengths: dict[int, int]  # output tokens by prompt index
    schedules: dict[float, list[float]]  # arrival offsets by rate
    highs: list[Prompt]
    high_lengths: dict[int, int]
    high_offsets: list[float]
    normal_offsets: list[float]


def workload(tokenizer: Any, plan: Plan) -> Workload:
    """The run's prompts, output lengths and arrival schedules: functions of the plan and the seeds."""
    schedules = {rate: poisson_arrivals(rate, plan.window_s, ARRIVAL_SEED) for rate in plan.rates}
    burst_span = plan.burst_before_s + plan.burst_s + plan.burst_after_s
    normal_offsets = burst_arrivals(
        plan.burst_normal_rate,
        factor=BURST_FACTOR,
        before_s=plan.burst_before_s,
        burst_s=plan.burst_s,
        after_s=plan.burst_after_s,
        seed=BURST_SEED,
    )
    high_offsets = poisson_arrivals(plan.burst_high_rate, burst_span, HIGH_SEED)
    size = max(
        *(len(s) for s in schedules.values()),
        len(normal_offsets),
        plan.peak_clients * 4,
        max(RAW_BATCHES) * plan.raw_calls,
    )
    pool = make_prompts(tokenizer, size)
    highs = make_prompts(tokenizer, max(1, len(high_offsets)), seed=HIGH_SEED)
    return Workload(
        pool=pool,
        lengths=dict(enumerate(output_lengths(size, LENGTH_SEED))),
        schedules=schedules,
        highs=highs,
        high_lengths=dict(enumerate(output_lengths(len(highs), HIGH_SEED))),
        high_offsets=high_offsets,
        normal_offsets=normal_offsets,
    )


# ---------------------------------------------------------------- phases


def sweep_point(system: System, work: Workload, rate: float, plan: Plan) -> dict[str, Any]:
    offsets = work.schedules[rate]
    prompts = work.pool[: len(offsets)]
    say(f"{system.name}: {rate:g} jobs/s, {len(offsets)} arrivals over {plan.window_s:.0f} s")
    run = asyncio.run(
        open_run(
            system.base_url,
            sized(system.make, work.lengths),
            prompts,
            offsets,
            cls=system.name,
            drain_cap_s=plan.drain_cap_s,
        )
    )
    figures = point_figures(run, rate, [work.lengths[p.index] for p in prompts], plan.window_s)
    say(
        f"{system.name} @ {rate:g}/s: {figures['ok']}/{figures['jobs']} ok, {figures['unfinished']} "
        f"unfinished, {figures['tokens_per_s']:.1f} tokens/s, P99 {figures['latency_p99_all_s'] or 0:.1f} s"
    )
    return figures


def point_figures(run: OpenRun, rate: float, lengths: list[int], window_s: float) -> dict[str, Any]:
    return {
        "rate": rate,
        "offered_tokens_per_s": offered_tokens_per_s(lengths, window_s),
        **job_figures(run),
        "jobs_detail": job_rows(run),
    }


def burst(system: System, work: Workload, plan: Plan) -> dict[str, Any]:
    say(
        f"{system.name}: burst, normal {plan.burst_normal_rate:g}/s -> x{BURST_FACTOR:g} for "
        f"{plan.burst_s:.0f} s, high {plan.burst_high_rate:g}/s"
    )
    normal = sized(lambda n: system.make(n, priority="normal"), work.lengths)
    high = sized(lambda n: system.make(n, priority="high"), work.high_lengths)
    streams = [
        ("normal", normal, work.pool[: len(work.normal_offsets)], work.normal_offsets),
        ("high", high, work.highs[: len(work.high_offsets)], work.high_offsets),
    ]
    runs = asyncio.run(burst_run(system.base_url, streams, drain_cap_s=plan.burst_drain_cap_s))
    b0, b1 = plan.burst_before_s, plan.burst_before_s + plan.burst_s
    end = b1 + plan.burst_after_s
    result: dict[str, Any] = {"window_s": {"before": [0.0, b0], "burst": [b0, b1], "after": [b1, end]}}
    for cls, run in runs.items():
        waits = queue_waits(run)
        figures = job_figures(run)
        result[cls] = {
            "arrivals": len(run.offsets),
            "before": wait_stats(waits, 0.0, b0),
            "during": wait_stats(waits, b0, b1),
            "after": wait_stats(waits, b1, end + plan.burst_drain_cap_s),
            "counts": {k: figures[k] for k in ("jobs", "ok", "refused", "failed", "unfinished")},
            "errors": figures["errors"],
            "load_average": figures["load_average"],
            "waits": [[round(a, 4), round(w, 5)] for a, w in waits],
        }
    say(
        f"burst: high queue wait P95 before {fmt_ms(result['high']['before']['p95_s'])}, during "
        f"{fmt_ms(result['high']['during']['p95_s'])}"
    )
    return result


def fmt_ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.0f} ms"


def peak(system: System, work: Workload, plan: Plan) -> dict[str, Any]:
    say(f"{system.name}: peak, {plan.peak_clients} closed-loop clients, {PEAK_TOKENS} tokens a job")
    run = asyncio.run(
        peak_run(
            system.base_url,
            system.make,
            work.pool[: plan.peak_clients * 4],
            clients=plan.peak_clients,
            max_tokens=PEAK_TOKENS,
            ramp_s=plan.peak_ramp_s,
            warm_s=plan.peak_warm_s,
            window_s=plan.peak_window_s,
        )
    )
    say(f"{system.name}: peak {run.tokens_per_s:.1f} tokens/s over {run.window_s:.0f} s")
    return {**asdict(run), "tokens_per_s": run.tokens_per_s}


def phases_of(name: str, plan: Plan) -> list[tuple[str, float]]:
    """What one system runs, in order: its sweep rates; Conveyor 1 stage then the burst and the peak."""
    rates = plan.second_layout_rates if name == CONVEYOR_2 else plan.rates
    extra = [("burst", 0.0), ("peak", 0.0)] if name == CONVEYOR_1 else []
    return [("rate", r) for r in rates] + extra


def bench_system(name: str, model: Model, work: Workload, plan: Plan, workdir: Path) -> dict[str, Any]:
    """The system's phases on one start; a phase that left jobs unfinished gets the system restarted
    before the next one (the work it had queued would run on into it)."""
    out: dict[str, Any] = {"points": {}, "starts": 0}
    started = time.perf_counter()
    phases = phases_of(name, plan)
    try:
        while phases:
            with start(name, model, workdir, work.pool) as system:
                out["starts"] += 1
                if not system.streams:
                    asyncio.run(warm_up_plain(system, work.pool))
                while phases:
                    kind, rate = phases.pop(0)
                    if kind == "rate":
                        figures = sweep_point(system, work, rate, plan)
                        out["points"][str(rate)] = figures
                        left = figures["unfinished"]
                    elif kind == "burst":
                        out["burst"] = burst(system, work, plan)
                        left = sum(out["burst"][c]["counts"]["unfinished"] for c in ("normal", "high"))
                    else:
                        out["peak"] = peak(system, work, plan)
                        left = 0
                    if left and phases:
                        say(f"{name}: {left} jobs unfinished: a fresh start for the next phase")
                        break
    except RuntimeError as exc:
        say(f"{name}: not measured: {exc}")
        out["error"] = str(exc)
    out["wall_s"] = time.perf_counter() - started
    return out


def bench_raw(model: Model, tokenizer: Any, work: Workload, plan: Plan) -> dict[str, Any]:
    runs = raw_limit(
        model,
        work.pool,
        int(tokenizer.pad_token_id),
        batches=RAW_BATCHES,
        calls=plan.raw_calls,
        max_tokens=PEAK_TOKENS,
    )
    gc.collect()
    return {
        run.name: {**{k: v for k, v in run.summary().items()}, "batch": b, "load_average": list(run.load)}
        for run, b in zip(runs, RAW_BATCHES, strict=True)
    }


# ---------------------------------------------------------------- main


def command_line(argv: list[str]) -> str:
    return " ".join([".venv/bin/python -m bench.suite", *argv])


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the short plan (make bench): under 10 minutes")
    parser.add_argument("--smoke", action="store_true", help="seconds per phase: a check of the machinery")
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument(
        "--systems", default=",".join(SYSTEMS), help=f"comma-separated, of: {', '.join(SYSTEMS)}"
    )
    parser.add_argument(
        "--rates",
        type=rates_arg,
        help="the sweep's rates in jobs/s, comma-separated (default: the plan's); must include its main rate",
    )
    parser.add_argument("--no-raw", action="store_true", help="skip the raw generate limit")
    parser.add_argument("--results", type=Path, default=RESULTS_DIR, help="where the report and plots go")
    return parser.parse_args(argv)


def rates_arg(text: str) -> tuple[float, ...]:
    try:
        rates = tuple(sorted({float(r) for r in text.split(",") if r.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from None
    if not rates or min(rates) <= 0:
        raise argparse.ArgumentTypeError(f"rates must be positive numbers: {text!r}")
    return rates


def with_rates(plan: Plan, rates: tuple[float, ...] | None) -> Plan:
    """The plan with its sweep narrowed or widened; the second layout runs the rates it ran before."""
    if rates is None:
        return plan
    if plan.main_rate not in rates:
        raise ValueError(f"--rates must include the comparison point, {plan.main_rate:g} jobs/s")
    second = tuple(r for r in rates if r in plan.second_layout_rates) or (plan.main_rate,)
    return replace(plan, rates=rates, second_layout_rates=second)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    try:
        plan = with_rates(SMOKE if args.smoke else QUICK if args.quick else FULL, args.rates)
    except ValueError as exc:
        say(str(exc))
        return 2
    names = [n.strip() for n in args.systems.split(",") if n.strip()]
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown:
        say(f"unknown systems {unknown}; choose from {list(SYSTEMS)}")
        return 2
    terminate_on_sigterm()
    workdir = Path(tempfile.mkdtemp(prefix="conveyor-suite-"))
    model = chosen_model(args.model, workdir)
    if model is None:
        return 2
    tokenizer = AutoTokenizer.from_pretrained(model.path)
    work = workload(tokenizer, plan)
    lengths = [work.lengths[p.index] for p in work.pool]
    meta: dict[str, Any] = {
        "command": command_line(argv),
        "plan": asdict(plan),
        "model": model.name,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "commit": git_commit(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "logs": str(workdir),
        "load_average_start": list(os.getloadavg()),
        "prompt_tokens": token_stats([len(p.ids) for p in work.pool]),
        "output_tokens": token_stats(lengths),
        "output_mean": sum(lengths) / len(lengths),
        "output_lengths": {"median": OUTPUT_MEDIAN, "sigma": OUTPUT_SIGMA, "bounds": list(OUTPUT_TOKENS)},
        "seeds": {"prompts": SEED, "lengths": LENGTH_SEED, "arrivals": ARRIVAL_SEED},
        "arrivals": {str(r): len(s) for r, s in work.schedules.items()},
        "systems": names,
    }
    say(f"suite ({plan.name}, {model.name}): plan {asdict(plan)}; logs in {workdir}")
    started = time.perf_counter()
    results: dict[str, Any] = {"raw": {}, "systems": {}}
    if not args.no_raw:
        results["raw"] = bench_raw(model, tokenizer, work, plan)
    for name in names:
        results["systems"][name] = bench_system(name, model, work, plan, workdir)
    meta["bench_wall_s"] = time.perf_counter() - started
    meta["load_average_end"] = list(os.getloadavg())
    text = markdown(results, meta)
    print(text)
    write_results("suite", text, payload(results, meta), args.results)
    plot_all(results, meta, args.results)
    return 1 if any("error" in r for r in results["systems"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
