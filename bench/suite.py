"""The benchmark suite: Conveyor against a naive server and Ray Serve: same model, prompts, machine and run.

Systems (bench/systems.py): the naive server (`generate` one request at a time), Ray Serve
(`@serve.batch` around `generate`), Conveyor with 1 and 2 stages, and in-process `generate` at
batch 32 and 64 (the raw limit). Every job asks for its own number of tokens with EOS ignored
(a seeded lognormal, median 64, clipped to 16-256) over bench.prompts' seeded chat requests.

1. Load sweep: open-loop Poisson arrivals at each rate of the plan for `window_s`, the same on
   every system, then `drain_cap_s`; unfinished jobs enter the P99 at the time they had waited, and
   a system that left some is started afresh for its next phase. `main_rate` (1 job/s) is the
   comparison point. Throughput: tokens of successful jobs / (first arrival to last completion).
2. Peak (Conveyor 1 stage): 64 closed-loop clients, 64 tokens a job, the token rate over a window
   after the ramp's prefills drained, against raw `generate`'s better batch size.
3. Burst (Conveyor 1 stage): `normal` jobs stepping up 10x for a window, `high` jobs throughout;
   the high jobs' queue wait (started_at - created_at) before and during, and no accepted job lost.

    .venv/bin/python -m bench.suite [--quick] [--model smollm2|tiny] [--systems "naive server,..."]
                                    [--rates 0.5,0.75,1] [--no-raw] [--results DIR]

--quick (`make bench`; `--model tiny` checks the machinery) takes under 10 minutes on 2 cores, the
full plan (`make bench-full`) an hour. Writes bench/results/suite.md, suite.json and three plots:
latency CDFs at the comparison rate, throughput and P99 against the load, the burst's queue waits.
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
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.streamers import BaseStreamer

from bench.load import (
    OUTPUT_MEDIAN,
    OUTPUT_SIGMA,
    OUTPUT_TOKENS,
    JobResult,
    Run,
    burst_arrivals,
    checked,
    loadavg,
    offered_tokens_per_s,
    open_runs,
    output_lengths,
    peak_run,
    poisson_arrivals,
    sized,
)
from bench.naive_server import generate_rows
from bench.prompts import SEED, Prompt, make_prompts
from bench.report import (
    RESULTS_DIR,
    Target,
    fmt,
    git_commit,
    job_figures,
    job_rows,
    jobs_cell,
    load_cell,
    queue_waits,
    ratio,
    summary,
    table,
    target_rows,
    token_stats,
    wait_stats,
    write_results,
)
from bench.systems import (
    Model,
    System,
    chosen_model,
    conveyor,
    naive,
    ray_serve,
    say,
    terminate_on_sigterm,
    warm_up,
)

NAIVE = "naive server"
RAY = "ray serve"
CONVEYOR_1 = "conveyor 1 stage"
CONVEYOR_2 = "conveyor 2 stages"
SYSTEMS = (NAIVE, RAY, CONVEYOR_1, CONVEYOR_2)
STAGE_SETTINGS: dict[str, dict[str, str]] = {
    CONVEYOR_1: {},
    # a thread per stage worker, so the two stages share the 2 cores
    CONVEYOR_2: {"CONVEYOR_STAGES": "2", "CONVEYOR_TORCH_THREADS": "1"},
}
COLORS = {NAIVE: "tab:red", RAY: "tab:orange", CONVEYOR_1: "tab:blue", CONVEYOR_2: "tab:green"}
LENGTH_SEED = SEED + 10  # output lengths of the main prompt pool
ARRIVAL_SEED = SEED + 11  # the sweep's Poisson schedule (one stream, scaled by each rate)
HIGH_SEED = SEED + 12  # the burst's high prompts, lengths and arrivals
BURST_SEED = SEED + 13  # the burst's normal arrivals
BURST_FACTOR = 10.0
PEAK_TOKENS = 64  # the peak and the raw limit: every job this long
RAW_BATCHES = (32, 64)


def conveyor_targets(name: str) -> list[Target]:
    return [
        Target(f"{name}: throughput vs naive", f"{name} / naive server throughput", 3.8, True),
        Target(f"{name}: p99 vs naive", f"{name} / naive server P99 latency", 0.58, False),
        Target(f"{name}: throughput vs ray", f"{name} / Ray Serve throughput", 1.2, True),
        Target(f"{name}: p99 vs ray", f"{name} / Ray Serve P99 latency", 0.8, False),
    ]


TARGETS = [
    *conveyor_targets(CONVEYOR_1),
    *conveyor_targets(CONVEYOR_2),
    Target("peak vs raw", f"{CONVEYOR_1} peak (closed loop) / raw generate, best batch", 0.8, True),
    Target("burst high p95 wait", "burst: high P95 queue wait, during / before", 1.5, False),
    Target(
        "burst lost jobs", "burst: accepted jobs lost (failed or unfinished)", 0, False, unit="", digits=0
    ),
]


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
QUICK = replace(  # under 10 minutes: shorter windows, 2 rates, the 2-stage layout at the main rate only
    FULL,
    name="quick",
    rates=(0.5, 1.0),
    window_s=20.0,
    drain_cap_s=20.0,
    burst_drain_cap_s=45.0,
    burst_before_s=10.0,
    burst_s=10.0,
    burst_after_s=5.0,
    peak_ramp_s=10.0,
    peak_warm_s=20.0,
    peak_window_s=30.0,
    raw_calls=1,
    second_layout_rates=(1.0,),
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


@contextmanager
def start(name: str, model: Model, workdir: Path, warm: list[Prompt]) -> Iterator[System]:
    """One of SYSTEMS, started and warmed up."""
    if name == NAIVE:
        started = naive(workdir, model)
    elif name == RAY:
        started = ray_serve(workdir, model)
    else:
        started = conveyor(name, workdir, STAGE_SETTINGS[name], model=model)
    with started as system:
        warm_up(system, warm)
        yield system


def sweep_point(system: System, work: Workload, rate: float, plan: Plan) -> dict[str, Any]:
    offsets = work.schedules[rate]
    prompts = work.pool[: len(offsets)]
    say(f"{system.name}: {rate:g} jobs/s, {len(offsets)} arrivals over {plan.window_s:.0f} s")
    stream = (system.name, sized(system.make, work.lengths), prompts, offsets)
    (run,) = asyncio.run(open_runs(system.base_url, [stream], drain_cap_s=plan.drain_cap_s))
    lengths = [work.lengths[p.index] for p in prompts]
    figures = {
        "rate": rate,
        "offered_tokens_per_s": offered_tokens_per_s(lengths, plan.window_s),
        **job_figures(run),
        "jobs_detail": job_rows(run),
    }
    say(
        f"{system.name} @ {rate:g}/s: {figures['ok']}/{figures['jobs']} ok, {figures['unfinished']} "
        f"unfinished, {figures['tokens_per_s']:.1f} tokens/s, P99 {figures['latency_p99_all_s'] or 0:.1f} s"
    )
    return figures


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
    runs = asyncio.run(open_runs(system.base_url, streams, drain_cap_s=plan.burst_drain_cap_s))
    b0, b1 = plan.burst_before_s, plan.burst_before_s + plan.burst_s
    end = b1 + plan.burst_after_s
    result: dict[str, Any] = {"window_s": {"before": [0.0, b0], "burst": [b0, b1], "after": [b1, end]}}
    for run in runs:
        waits = queue_waits(run)
        figures = job_figures(run)
        result[run.name] = {
            "arrivals": len(run.offsets),
            "before": wait_stats(waits, 0.0, b0),
            "during": wait_stats(waits, b0, b1),
            "after": wait_stats(waits, b1, end + plan.burst_drain_cap_s),
            "counts": {k: figures[k] for k in ("jobs", "ok", "refused", "failed", "unfinished")},
            "errors": figures["errors"],
            "load_average": figures["load_average"],
            "waits": [[round(a, 4), round(w, 5)] for a, w in waits],
        }
    high = result["high"]
    before, during = (fmt(high[phase]["p95_s"], 1000, 0) for phase in ("before", "during"))
    say(f"burst: high queue wait P95 before {before} ms, during {during} ms")
    return result


def peak(system: System, work: Workload, plan: Plan) -> dict[str, Any]:
    say(f"{system.name}: peak, {plan.peak_clients} closed-loop clients, {PEAK_TOKENS} tokens a job")
    figures = asyncio.run(
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
    say(f"{system.name}: peak {figures['tokens_per_s']:.1f} tokens/s over {figures['window_s']:.0f} s")
    return figures


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


class FirstTokenClock(BaseStreamer):
    """Notes when `generate` hands out its first new token (its first `put` is the prompt)."""

    def __init__(self) -> None:
        self.puts = 0
        self.first_token_at: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


def generate_batch(model: Any, prompts: Sequence[Prompt], pad_id: int, max_tokens: int) -> list[JobResult]:
    """One `generate` call over `prompts`; every job's latency is the call, its TTFT the first token."""
    clock = FirstTokenClock()
    started = time.perf_counter()
    try:
        new = generate_rows(model, [p.ids for p in prompts], pad_id, max_tokens, exact=True, streamer=clock)
    except Exception as exc:  # a failed call fails its jobs; the run goes on
        elapsed = time.perf_counter() - started
        return [JobResult(p.index, False, elapsed, None, 0, f"{type(exc).__name__}: {exc}") for p in prompts]
    elapsed = time.perf_counter() - started
    ttft = clock.first_token_at - started if clock.first_token_at is not None else None
    return [
        checked(
            JobResult(p.index, True, elapsed, ttft, int(new.shape[1]), token_ids=new[i].tolist()), max_tokens
        )
        for i, p in enumerate(prompts)
    ]


def run_raw(model: Any, prompts: Sequence[Prompt], pad_id: int, batch: int, max_tokens: int) -> Run:
    """The prompts in batches of `batch`, one `generate` call after another, after a short warm-up call."""
    generate_batch(model, prompts[:1], pad_id, 8)  # warm-up
    jobs: list[JobResult] = []
    load = loadavg()
    started = time.perf_counter()
    for first in range(0, len(prompts), batch):
        jobs += generate_batch(model, prompts[first : first + batch], pad_id, max_tokens)
    wall = time.perf_counter() - started
    return Run(f"raw generate b{batch}", jobs, wall, (load, loadavg()), clients=batch)


def bench_raw(model: Model, tokenizer: Any, work: Workload, plan: Plan) -> dict[str, Any]:
    """In-process `generate` (the raw limit: the model loaded here, not started) at each batch size:
    `raw_calls` calls of `batch` prompts, `PEAK_TOKENS` each; a job's latency is its call, its TTFT the
    call's first token. The model is dropped afterwards to free its memory."""
    generator = AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.float32).eval()
    out = {}
    for batch in RAW_BATCHES:
        prompts = work.pool[: batch * plan.raw_calls]
        run = run_raw(generator, prompts, int(tokenizer.pad_token_id), batch, PEAK_TOKENS)
        ok, rate = f"{len(run.ok)}/{len(run.jobs)}", run.tokens_per_s()
        say(f"{run.name}: {ok} jobs, {rate:.1f} tokens/s over {run.wall_s:.1f} s")
        out[run.name] = {**summary(run), "batch": batch, "load_average": list(run.load)}
    del generator
    gc.collect()
    return out


def point(results: dict[str, Any], name: str, rate: float) -> dict[str, Any] | None:
    system = results.get("systems", {}).get(name) or {}
    return (system.get("points") or {}).get(str(rate))


def ratios(results: dict[str, Any], main_rate: float) -> dict[str, float | None]:
    """Every target's value from the results; None where a figure is missing."""
    out: dict[str, float | None] = {}
    naive, ray = point(results, NAIVE, main_rate), point(results, RAY, main_rate)
    for name in (CONVEYOR_1, CONVEYOR_2):
        mine = point(results, name, main_rate)
        for other, key in ((naive, "naive"), (ray, "ray")):
            out[f"{name}: throughput vs {key}"] = (
                ratio(mine["tokens_per_s"], other["tokens_per_s"]) if mine and other else None
            )
            out[f"{name}: p99 vs {key}"] = (
                ratio(mine["latency_p99_all_s"], other["latency_p99_all_s"]) if mine and other else None
            )
    conveyor = results.get("systems", {}).get(CONVEYOR_1) or {}
    raw_best = max((r["tokens_per_s"] for r in (results.get("raw") or {}).values()), default=None)
    peak = (conveyor.get("peak") or {}).get("tokens_per_s")
    out["peak vs raw"] = ratio(peak, raw_best)
    burst = conveyor.get("burst")
    if burst:
        high = burst["high"]
        out["burst high p95 wait"] = ratio(high["during"]["p95_s"], high["before"]["p95_s"])
        out["burst lost jobs"] = float(
            sum(burst[c]["counts"]["failed"] + burst[c]["counts"]["unfinished"] for c in ("normal", "high"))
        )
    else:
        out["burst high p95 wait"] = out["burst lost jobs"] = None
    return out


def main_rows(results: dict[str, Any], rate: float) -> list[str]:
    cells = []
    for name in (n for n in SYSTEMS if n in results.get("systems", {})):
        f = point(results, name, rate)
        if f is None:
            cells.append([name, "not measured", *[""] * 7])
            continue
        latencies = [fmt(f[k]) for k in ("latency_p50_s", "latency_p99_s", "latency_p99_all_s", "ttft_p50_s")]
        itl = fmt(f["itl_p50_s"], 1000, 0) if f["itl_p50_s"] is not None else "(not streamed)"
        tokens = fmt(f["tokens_per_s"], digits=1)
        cells.append([name, jobs_cell(f), tokens, *latencies, itl, load_cell(f.get("load_average"))])
    return table(
        "system | ok/submitted> | tokens/s> | latency p50 (s)> | p99, done (s)> | p99 with unfinished (s)> "
        "| TTFT p50 (s)> | ITL p50 (ms)> | load average>",
        cells,
    )


def sweep_rows(results: dict[str, Any], rates: list[float]) -> list[str]:
    cells = [
        [name, f"{rate:g}", fmt(f["offered_tokens_per_s"], digits=1), jobs_cell(f)]
        + [fmt(f["tokens_per_s"], digits=1), fmt(f["latency_p99_all_s"]), load_cell(f.get("load_average"))]
        for name in SYSTEMS
        for rate in rates
        if (f := point(results, name, rate)) is not None
    ]
    return table(
        "system | jobs/s> | tokens/s asked> | ok/submitted> | tokens/s> | p99 with unfinished (s)> "
        "| load average>",
        cells,
    )


def peak_rows(results: dict[str, Any], meta: dict[str, Any]) -> list[str]:
    cells = [
        [name, fmt(r["tokens_per_s"], digits=1)]
        + [f"{r['jobs']} prompts, {r['jobs'] // r['batch']} `generate` call(s) of {r['batch']}, 64 tokens"]
        + [load_cell(r["load_average"])]
        for name, r in (results.get("raw") or {}).items()
    ]
    peak = (results.get("systems", {}).get(CONVEYOR_1) or {}).get("peak")
    if peak:
        opens = meta["plan"]["peak_ramp_s"] + meta["plan"]["peak_warm_s"]
        how = (
            f"{peak['clients']} closed-loop clients (64 tokens a job), tokens received over "
            f"{peak['window_s']:.0f} s from {opens:.0f} s after the first ({peak['jobs_ended']} jobs ended, "
            f"{peak['failed']} failed)"
        )
        cells.append((CONVEYOR_1, fmt(peak["tokens_per_s"], digits=1), how, load_cell(peak["load"])))
    return table("system | tokens/s> | how | load average>", cells)


def burst_rows(burst: dict[str, Any]) -> list[str]:
    cells = []
    for cls in ("high", "normal"):
        for phase, s in ((phase, burst[cls][phase]) for phase in ("before", "during", "after")):
            waits = (fmt(s["median_s"], 1000, 0), fmt(s["p95_s"], 1000, 0))
            cells.append((cls, burst[cls]["arrivals"], phase, s["jobs"], *waits))
    return table("class | arrivals> | phase | jobs> | queue wait median (ms)> | queue wait p95 (ms)>", cells)


def burst_section(results: dict[str, Any], meta: dict[str, Any]) -> list[str]:
    conveyor = results.get("systems", {}).get(CONVEYOR_1) or {}
    burst = conveyor.get("burst")
    if not burst:
        return [f"Not measured: {conveyor.get('error', 'conveyor 1 stage not in this run')}"]
    plan = meta["plan"]
    counts = "; ".join(
        f"{cls}: " + ", ".join(f"{v} {k}" for k, v in burst[cls]["counts"].items())
        for cls in ("normal", "high")
    )
    return [
        f"`normal` jobs at {plan['burst_normal_rate']:g}/s for {plan['burst_before_s']:.0f} s, "
        f"{10 * plan['burst_normal_rate']:g}/s for {plan['burst_s']:.0f} s, "
        f"{plan['burst_normal_rate']:g}/s for {plan['burst_after_s']:.0f} s; `high` jobs at "
        f"{plan['burst_high_rate']:g}/s throughout. Queue wait: started_at - created_at (until "
        "its prefill began) from each job's final record, by submit time.",
        "",
        *burst_rows(burst),
        "",
        f"- jobs: {counts} (a lost job: accepted with 202, then failed or unfinished; refused: 429/503 "
        "at submit)",
    ]


def notes(results: dict[str, Any], meta: dict[str, Any]) -> list[str]:
    lines = [
        f"- offered loads (jobs/s: arrivals in {meta['plan']['window_s']:.0f} s): "
        + ", ".join(f"{r}: {n}" for r, n in meta["arrivals"].items()),
        "- 1-minute load average (2 cores, shared with other work): start "
        f"{load_cell(meta['load_average_start'][:1])}, end {load_cell(meta['load_average_end'][:1])}; "
        "per run in the tables (before -> after)",
        "- wall time per system: "
        + ", ".join(f"{n} {s.get('wall_s', 0) / 60:.1f} min" for n, s in results.get("systems", {}).items()),
    ]
    for name, s in results.get("systems", {}).items():
        if "error" in s:
            lines.append(f"- {name}: not (fully) measured: {s['error']}")
        for rate, f in (s.get("points") or {}).items():
            lines += [f"- {name} @ {rate}/s: {e}" for e in f.get("errors") or []]
    return lines


def markdown(results: dict[str, Any], meta: dict[str, Any]) -> str:
    plan = meta["plan"]
    main = plan["main_rate"]
    main_point = next((point(results, n, main) for n in SYSTEMS if point(results, n, main) is not None), None)
    asked = f", {main_point['offered_tokens_per_s']:.0f} tokens/s asked" if main_point else ""
    lines = [
        f"# Conveyor benchmark suite ({plan['name']}, {meta['model']})",
        "",
        f"Every number below comes from `{meta['command']}` ({meta['started']}, commit {meta['commit']}, "
        f"{meta['bench_wall_s'] / 60:.1f} min in all).",
        "",
        f"{meta['model']}, fp32, CPU ({meta['cpus']} cores), greedy, EOS ignored: each job generates exactly "
        f"its own length. Prompts: seeded chat requests ({meta['prompt_tokens']} tokens); output lengths "
        f"lognormal (median {meta['output_lengths']['median']}, sigma {meta['output_lengths']['sigma']}) "
        f"clipped to {meta['output_lengths']['bounds']}: {meta['output_tokens']}, "
        f"mean {meta['output_mean']:.0f}. "
        "Latency and TTFT on the client's clock; throughput = tokens of successful jobs / (first arrival to "
        "last completion).",
        "",
        "## Targets",
        "",
        *target_rows(TARGETS, ratios(results, main)),
        "",
        f"## Open loop at {main:g} job/s (the comparison point)",
        "",
        f"Poisson arrivals for {plan['window_s']:.0f} s ({meta['arrivals'].get(str(main), 0)} jobs{asked}), "
        f"the same on every system; each gets {plan['drain_cap_s']:.0f} s after the last arrival, then its "
        "unfinished jobs count at the time they had waited (P99 with unfinished: a lower bound). "
        "Non-streaming servers' TTFT is their latency.",
        "",
        *main_rows(results, main),
        "",
        "## Load sweep",
        "",
        *sweep_rows(results, list(plan["rates"])),
        "",
        "## Peak and the raw limit",
        "",
        *peak_rows(results, meta),
        "",
        f"## Burst ({CONVEYOR_1})",
        "",
        *burst_section(results, meta),
        "",
        "## Notes",
        "",
        *notes(results, meta),
    ]
    return "\n".join(lines) + "\n"


def payload(results: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    return {
        "meta": meta,
        "targets": {t.key: {"goal": t.goal, "at_least": t.at_least} for t in TARGETS},
        "ratios": ratios(results, meta["plan"]["main_rate"]),
        "results": results,
    }


def cdf_points(latencies: list[float], submitted: int) -> tuple[list[float], list[float]]:
    """(sorted latencies, fraction of the submitted jobs done by each): a CDF that ends below 1 when
    jobs never finished."""
    ordered = sorted(latencies)
    return ordered, [(i + 1) / submitted for i in range(len(ordered))] if submitted else []


def latency_cdf(plt: Any, results: dict[str, Any], meta: dict[str, Any]) -> Any:
    main = str(meta["plan"]["main_rate"])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in SYSTEMS:
        point = ((results["systems"].get(name) or {}).get("points") or {}).get(main)
        if point:
            latencies = [j["latency_s"] for j in point["jobs_detail"] if j["status"] == "succeeded"]
            label = f"{name} ({point['ok']}/{point['jobs']} done)"
            ax.step(*cdf_points(latencies, point["jobs"]), where="post", label=label, color=COLORS.get(name))
    ax.set(xscale="log", xlabel="end-to-end latency (s, log scale)", ylabel="fraction of submitted jobs done")
    ax.set(ylim=(0, 1.02), title=f"Latency CDF at {main} jobs/s ({meta['model']}, {meta['plan']['name']})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    return fig


def load_plot(plt: Any, results: dict[str, Any], meta: dict[str, Any]) -> Any:
    fig, (tput, p99) = plt.subplots(1, 2, figsize=(11, 4.5))
    top = 1.0
    for name in SYSTEMS:
        points = (results["systems"].get(name) or {}).get("points") or {}
        ordered = sorted(points.values(), key=lambda p: p["offered_tokens_per_s"])
        offered = [p["offered_tokens_per_s"] for p in ordered]
        top = max([top, *offered])
        style = {"marker": "o", "label": name, "color": COLORS.get(name)}
        if ordered:
            tput.plot(offered, [p["tokens_per_s"] for p in ordered], **style)
            p99.plot(offered, [p["latency_p99_all_s"] or float("nan") for p in ordered], **style)
    tput.plot([0, top], [0, top], linestyle=":", color="grey", label="= offered")
    tput.set(xlabel="offered load (tokens/s asked)", ylabel="throughput (tokens/s)", title="Throughput")
    p99.set(xlabel="offered load (tokens/s asked)", yscale="log", title="P99 latency")
    p99.set_ylabel("P99 end-to-end latency (s), unfinished jobs included")
    for ax in (tput, p99):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{meta['model']}, {meta['plan']['name']} plan, {meta['cpus']} cores")
    return fig


def burst_plot(plt: Any, results: dict[str, Any], meta: dict[str, Any]) -> Any:
    burst = (results["systems"].get(CONVEYOR_1) or {}).get("burst")
    fig, ax = plt.subplots(figsize=(9, 4.5))
    if burst:
        ax.axvspan(*burst["window_s"]["burst"], color="grey", alpha=0.15, label="burst (normal x10)")
        for cls, color in (("normal", "tab:blue"), ("high", "tab:red")):
            waits = burst[cls]["waits"]
            ax.scatter([a for a, _ in waits], [w * 1000 for _, w in waits], s=14, color=color, label=cls)
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "burst not measured", ha="center", va="center", transform=ax.transAxes)
    ax.set(xlabel="submit time (s from the start)", ylabel="queue wait, started_at - created_at (ms)")
    ax.set_title(f"{CONVEYOR_1}: queue wait through a 10x burst ({meta['model']}, {meta['plan']['name']})")
    ax.grid(True, which="both", alpha=0.3)
    return fig


PLOTS = {"suite_latency_cdf.png": latency_cdf, "suite_load.png": load_plot, "suite_burst.png": burst_plot}


def plot_all(results: dict[str, Any], meta: dict[str, Any], directory: Path = RESULTS_DIR) -> None:
    """The three PNGs; a missing matplotlib is reported, not fatal (the tables are written already)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        say(f"no plots: matplotlib is not installed ({exc}); pip install -e '.[bench]'")
        return
    directory.mkdir(parents=True, exist_ok=True)
    for name, draw in PLOTS.items():
        fig = draw(plt, results, meta)
        fig.tight_layout()
        fig.savefig(directory / name, dpi=110)
        plt.close(fig)
    say(f"wrote the plots {', '.join(PLOTS)} in {directory}")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the short plan (make bench): under 10 minutes")
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
        plan = with_rates(QUICK if args.quick else FULL, args.rates)
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
        "command": " ".join([".venv/bin/python -m bench.suite", *argv]),
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
