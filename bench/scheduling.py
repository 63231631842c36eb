"""The scheduling benchmark: priority classes under saturation, and iteration-level against request-level
batching under an open-loop Poisson load, each as ratios measured within one run.

1. Priority (one stack, continuous batching, default settings). `high` jobs arrive as a seeded Poisson
   stream (1/s, short prompts, 16 tokens each): first alone (unloaded), then with the same arrival
   schedule and prompts while closed-loop `normal` clients (64, each job 64 tokens) keep the stack
   saturated. Target: the high jobs' P95 time to first token (TTFT) loaded <= 1.5x unloaded. The
   normal jobs' TTFT under the same load is shown for contrast.
2. Capacity: after the high stream, the same normal load runs on alone for a window; the rate of
   token events the clients receive, divided by the tokens per job, is the stack's capacity in
   jobs/s for this job shape (continuous batching, steady state). Then the normal clients stop and
   their jobs in flight run to the end, so that every normal job submitted under the high stream
   is counted (a job cut off would bias its TTFT low).
3. Poisson: open-loop arrivals at 70% of that capacity for a fixed window (one seeded schedule, the
   same prompts), on a fresh stack with CONVEYOR_BATCHING=continuous and again on one with
   `request`, all else equal. Per mode: TTFT P50/P95/P99, latency, and throughput over the arrival
   window plus the drain (first arrival to last completion). Targets: P99 TTFT continuous/request
   <= 0.5 at a throughput ratio >= 1.0 (equal within noise).

Latencies and TTFT are on the client's clock (POST /v1/jobs to the first SSE token event). A submit
answered 429 or 503 counts as refused, apart from failures. A probe samples the jobs waiting per class
and stage 0's step time while load runs.

    .venv/bin/python -m bench.scheduling [--duration-s 60] [--poisson-s 120] [--model smollm2|tiny]
                                         [--normal-clients 64] [--load 0.7] [--priority-only]

About 11 minutes with the defaults on 2 cores (SmolLM2-135M-Instruct). `--model tiny` runs the
tests' tiny random Llama instead: a smoke run of the machinery whose figures say nothing about the
model's. Prints Markdown tables and a verdict per target; writes bench/results/scheduling.md and
bench/results/scheduling.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from bench.load import (
    JobResult,
    TokenLog,
    closed_loop_until,
    conveyor_job,
    cycled,
    load_client,
    loadavg,
    open_loop,
    open_run,
    poisson_arrivals,
)
from bench.prompts import SEED, Prompt, make_prompts
from bench.report import (
    Target,
    class_summary,
    fmt,
    git_commit,
    job_record,
    jobs_cell,
    ratio,
    row,
    target_rows,
    throughput,
    token_stats,
    write_results,
)
from bench.systems import (
    Model,
    Probe,
    System,
    batch_log,
    chosen_model,
    conveyor,
    say,
    terminate_on_sigterm,
    warm_up,
)

HIGH_SEED = SEED + 1  # the high stream's arrivals and prompts
POISSON_SEED = SEED + 2
SHORT_USER_TOKENS = (10, 30)  # the high jobs' user messages: short interactive requests
NOISE = 0.05  # a throughput ratio this close under 1.0 is equal within this machine's noise


@dataclass(frozen=True)
class Plan:
    duration_s: float = 60.0  # each high stream (unloaded, saturated) and the capacity window
    poisson_s: float = 120.0  # the Poisson arrival window, per batching mode
    ramp_s: float = 20.0  # the normal clients start one after another over this long
    high_rate: float = 1.0  # high jobs per second
    high_tokens: int = 16
    normal_tokens: int = 64
    normal_clients: int = 64  # = CONVEYOR_MAX_RUNNING_SEQUENCES' default: a full running batch
    load: float = 0.7  # the Poisson rate, as a fraction of the measured capacity
    drain_cap_s: float = 180.0  # after the last arrival, jobs still running are given up after this


def targets(load: float) -> list[Target]:
    at = f"at {load:.0%} load"
    return [
        Target("high_p95_ttft_saturated_vs_unloaded", "high P95 TTFT, saturated / unloaded", 1.5, False),
        Target("p99_ttft_continuous_vs_request", f"P99 TTFT {at}, continuous / request", 0.5, False),
        Target(
            "throughput_continuous_vs_request",
            f"throughput {at}, continuous / request",
            1.0,
            True,
            noise=NOISE,
        ),
    ]


# ---------------------------------------------------------------- experiments


async def priority_run(
    system: System, plan: Plan, highs: list[Prompt], normals: list[Prompt]
) -> dict[str, Any]:
    """Phase A (high alone), phase B (high under normal saturation), phase C (normal alone: capacity)."""
    offsets = poisson_arrivals(plan.high_rate, plan.duration_s, HIGH_SEED)
    high_prompts = cycled(highs, len(offsets))
    high = conveyor_job(plan.high_tokens, priority="high")
    tokens = TokenLog()
    normal = conveyor_job(plan.normal_tokens, priority="normal", on_token=tokens.add)
    unloaded: list[JobResult] = []
    loaded: list[JobResult] = []
    normal_done: list[JobResult] = []
    normal_submits: list[float] = []
    probe = Probe(system)
    probing = asyncio.create_task(probe.run())
    load = [loadavg()]
    async with load_client(system.base_url, plan.normal_clients + 32) as client:
        a_start = time.perf_counter() + 0.2
        say(f"priority A: {len(offsets)} high jobs alone over {plan.duration_s:.0f} s")
        await open_loop(client, high, high_prompts, offsets, cls="high", start=a_start, done=unloaded)
        a_end = time.perf_counter()
        load.append(loadavg())
        say(
            f"priority B: {plan.normal_clients} normal clients over {plan.ramp_s:.0f} s, then the high stream"
        )
        stop = asyncio.Event()
        loops = asyncio.create_task(
            closed_loop_until(
                client,
                normal,
                normals,
                clients=plan.normal_clients,
                cls="normal",
                stagger_s=plan.ramp_s,
                stop=stop,
                done=normal_done,
                submitted=normal_submits,
            )
        )
        await asyncio.sleep(plan.ramp_s)
        b_start = time.perf_counter()
        await open_loop(client, high, high_prompts, offsets, cls="high", start=b_start, done=loaded)
        b_end = time.perf_counter()
        load.append(loadavg())
        say(f"priority C: normal alone for {plan.duration_s:.0f} s (capacity)")
        await asyncio.sleep(plan.duration_s)
        c_end = time.perf_counter()
        load.append(loadavg())
        say("priority: the normal clients stop; their jobs in flight run to the end")
        stop.set()
        try:
            await asyncio.wait_for(loops, plan.drain_cap_s)
        except TimeoutError:
            say(f"priority: normal jobs still in flight after {plan.drain_cap_s:.0f} s, given up")
    batches = await batch_log(system)
    await stop_probe(probing)
    in_b = [j for j in normal_done if b_start <= j.submitted < b_end]
    b_tokens = tokens.between(b_start, b_end) / (b_end - b_start)
    c_tokens = tokens.between(b_end, c_end) / (c_end - b_end)
    return {
        "high_unloaded": class_summary(unloaded),
        "high_saturated": class_summary(loaded),
        "normal_saturated": class_summary(in_b, submitted=sum(b_start <= t < b_end for t in normal_submits)),
        "saturated_normal_tokens_per_s": b_tokens,
        "capacity_tokens_per_s": c_tokens,
        "capacity_jobs_per_s": c_tokens / plan.normal_tokens,
        "capacity_completions_per_s": sum(1 for j in normal_done if b_end <= j.ended < c_end)
        / (c_end - b_end),
        "windows_s": {"unloaded": a_end - a_start, "saturated": b_end - b_start, "capacity": c_end - b_end},
        "probe": {
            "unloaded": probe.window(a_start, a_end),
            "saturated": probe.window(b_start, b_end),
            "capacity": probe.window(b_end, c_end),
        },
        "batches": {
            "unloaded": batch_stats(batches, a_start, a_end),
            "saturated": batch_stats(batches, b_start, b_end),
            "capacity": batch_stats(batches, b_end, c_end),
        },
        "load_average": load,
        "high_arrivals": len(offsets),
        "jobs": [job_line(j, a_start, "unloaded") for j in unloaded]
        + [job_line(j, b_start, "saturated") for j in (*loaded, *in_b)],
    }


async def poisson_run(
    system: System, plan: Plan, prompts: list[Prompt], offsets: list[float]
) -> dict[str, Any]:
    """Open-loop arrivals at `offsets`; waits for the last job, up to `drain_cap_s` after the last arrival."""
    probe = Probe(system)
    probing = asyncio.create_task(probe.run())
    job = conveyor_job(plan.normal_tokens)
    run = await open_run(
        system.base_url, job, prompts, offsets, cls=system.name, drain_cap_s=plan.drain_cap_s, clients=256
    )
    if len(run.jobs) < len(offsets):
        say(
            f"{system.name}: {len(offsets) - len(run.jobs)} jobs unfinished "
            f"{plan.drain_cap_s:.0f} s after the last arrival"
        )
    batches = await batch_log(system)
    await stop_probe(probing)
    summary = class_summary(run.jobs, submitted=len(offsets))
    summary.update(throughput(run.jobs, run.start))
    summary["drain_s"] = max(0.0, summary["span_s"] - offsets[-1])
    say(
        f"{system.name}: {summary['ok']}/{len(offsets)} ok, {summary['jobs_per_s']:.2f} jobs/s, "
        f"TTFT p99 {summary['ttft_p99_s'] or 0:.2f} s"
    )
    return {
        "summary": summary,
        "probe": probe.window(run.start, run.end),
        "batches": batch_stats(batches, run.start, run.end),
        "load_average": list(run.load),
        "jobs": [job_line(j, run.start, "poisson") for j in run.jobs],
    }


async def stop_probe(probing: asyncio.Task[None]) -> None:
    """Cancel the probe and wait for it, briefly: a Redis client cancelled mid-command may not close."""
    probing.cancel()
    await asyncio.wait({probing}, timeout=5.0)


def job_line(job: JobResult, origin: float, phase: str) -> dict[str, Any]:
    """One job for the JSON: its phase and class, submit time from the phase's start, its result."""
    return {"phase": phase, "class": job.cls, "submitted_s": job.submitted - origin, **job_record(job)}


def batch_stats(entries: Sequence[tuple[float, dict[str, str]]], start: float, end: float) -> dict[str, Any]:
    """What the batcher and the workers did in [start, end), from the batch log (time, fields) in order.

    A dispatch entry has a `bucket`; a batch that joined a running one has a second entry with
    `joined` (its host). A dispatched batch with no join entry ran on its own: every batch does with
    request-level batching; with continuous batching, one that found no running batch with room.
    The longest gap counts from `start` to the first dispatch, between dispatches, and from the last
    one to `end`: time in which no new batch was started.
    """
    joined_ids = {f["batch_id"] for _, f in entries if "joined" in f}
    dispatched = [(t, f) for t, f in entries if "bucket" in f and start <= t < end]
    hosts = Counter(f["joined"] for t, f in entries if "joined" in f and start <= t < end)
    times = [start, *(t for t, _ in dispatched), end]
    return {
        "dispatched": len(dispatched),
        "joined": sum(1 for _, f in dispatched if f["batch_id"] in joined_ids),
        "ran_alone": sum(1 for _, f in dispatched if f["batch_id"] not in joined_ids),
        "sizes": [int(f["size"]) for _, f in dispatched],
        "joins_into_busiest_host": max(hosts.values(), default=0),
        "longest_gap_s": max(b - a for a, b in zip(times, times[1:], strict=False)),
    }


# ---------------------------------------------------------------- report


def ratios(results: dict[str, Any]) -> dict[str, float | None]:
    """High P95 TTFT saturated/unloaded; P99 TTFT and jobs/s continuous/request (None where missing)."""
    prio, poisson = results.get("priority", {}), results.get("poisson", {})
    cont = (poisson.get("continuous") or {}).get("summary") or {}
    req = (poisson.get("request") or {}).get("summary") or {}
    return {
        "high_p95_ttft_saturated_vs_unloaded": ratio(
            (prio.get("high_saturated") or {}).get("ttft_p95_s"),
            (prio.get("high_unloaded") or {}).get("ttft_p95_s"),
        ),
        "p99_ttft_continuous_vs_request": ratio(cont.get("ttft_p99_s"), req.get("ttft_p99_s")),
        "throughput_continuous_vs_request": ratio(cont.get("jobs_per_s"), req.get("jobs_per_s")),
    }


def ttft_row(name: str, s: dict[str, Any]) -> str:
    """| name | jobs | TTFT p50 / p95 / p99 (ms) | latency p50 / p99 (s) |"""
    return row(
        name,
        jobs_cell(s),
        *(fmt(s[f"ttft_p{q}_s"], 1000, 0) for q in (50, 95, 99)),
        fmt(s["latency_p50_s"]),
        fmt(s["latency_p99_s"]),
    )


TTFT_HEADER = [
    "| jobs | ok/submitted | TTFT p50 (ms) | TTFT p95 (ms) | TTFT p99 (ms) "
    "| latency p50 (s) | latency p99 (s) |",
    "|---|---:|---:|---:|---:|---:|---:|",
]


def batch_line(name: str, b: dict[str, Any]) -> str:
    """What the batch log says about one window: dispatches, joins, batches alone, the longest stall."""
    sizes = sorted(b["sizes"]) or [0]
    return (
        f"- {name}: {b['dispatched']} batches dispatched (size median {sizes[len(sizes) // 2]}, "
        f"max {sizes[-1]}); {b['joined']} joined a running batch ({b['joins_into_busiest_host']} joins "
        f"into the busiest host), {b['ran_alone']} ran on their own; longest time with no batch "
        f"dispatched: {b['longest_gap_s']:.1f} s"
    )


def priority_section(prio: dict[str, Any], meta: dict[str, Any]) -> list[str]:
    plan = meta["plan"]
    if "error" in prio:
        return [f"Not measured: {prio['error']}"]
    sat, cap = prio["probe"]["saturated"], prio["probe"]["capacity"]
    return [
        f"`high` jobs arrive as a seeded Poisson stream ({plan['high_rate']:g}/s for "
        f"{plan['duration_s']:.0f} s, {prio['high_arrivals']} jobs; prompts of {meta['high_prompt_tokens']} "
        f"tokens; {plan['high_tokens']} tokens each), first alone, then with the same schedule while "
        f"{plan['normal_clients']} closed-loop `normal` clients ({plan['normal_tokens']} tokens a job, "
        f"prompts of {meta['normal_prompt_tokens']} tokens) saturate the stack. Continuous batching, "
        "default settings.",
        "",
        "| phase | class " + TTFT_HEADER[0].removeprefix("| jobs "),
        "|---" + TTFT_HEADER[1],
        ttft_row("unloaded | high", prio["high_unloaded"]),
        ttft_row("saturated | high", prio["high_saturated"]),
        ttft_row("saturated | normal", prio["normal_saturated"]),
        "",
        f"- normal throughput while saturated: {prio['saturated_normal_tokens_per_s']:.1f} tokens/s; "
        f"alone afterwards (the capacity window, {prio['windows_s']['capacity']:.0f} s): "
        f"{prio['capacity_tokens_per_s']:.1f} tokens/s = {prio['capacity_jobs_per_s']:.2f} jobs/s "
        f"({prio['capacity_completions_per_s']:.2f} completions/s)",
        "- jobs waiting in the intake while saturated, median / max: "
        f"{fmt(sat['waiting_median'], digits=0)} / "
        f"{fmt(sat['waiting_max'], digits=0)} (capacity window: {fmt(cap['waiting_median'], digits=0)} / "
        f"{fmt(cap['waiting_max'], digits=0)})",
        f"- stage 0 step time (worker's EWMA, prefills and decode steps), median: unloaded "
        f"{fmt(prio['probe']['unloaded']['step_ewma_median_s'], 1000, 0)} ms, saturated "
        f"{fmt(sat['step_ewma_median_s'], 1000, 0)} ms",
        f"- high P95 TTFT on the server's clock (first_token_at - created_at): unloaded "
        f"{fmt(prio['high_unloaded']['server_ttft_p95_s'], 1000, 0)} ms, saturated "
        f"{fmt(prio['high_saturated']['server_ttft_p95_s'], 1000, 0)} ms; P95 of its parts, unloaded / "
        "saturated: "
        + ", ".join(
            f"{name} {fmt(prio['high_unloaded']['phases_p95_s'].get(name), 1000, 0)} / "
            f"{fmt(prio['high_saturated']['phases_p95_s'].get(name), 1000, 0)} ms"
            for name in ("intake", "handoff", "prefill")
        )
        + " (intake: created -> scheduled; handoff: -> started on stage 0; prefill: -> first token)",
        f"- windows: unloaded {prio['windows_s']['unloaded']:.0f} s, saturated "
        f"{prio['windows_s']['saturated']:.0f} s (each high stream's window lasts until its last job ends)",
        batch_line("batches while saturated", prio["batches"]["saturated"]),
        batch_line("batches in the capacity window", prio["batches"]["capacity"]),
    ]


def poisson_row(mode: str, run: dict[str, Any]) -> str:
    if "error" in run:
        return f"| {mode} | not measured | | | | | | | | | |"
    s, probe = run["summary"], run["probe"]
    return row(
        mode,
        jobs_cell(s),
        fmt(s["jobs_per_s"]),
        fmt(s["tokens_per_s"], digits=1),
        *(fmt(s[f"ttft_p{q}_s"], 1000, 0) for q in (50, 95, 99)),
        fmt(s["latency_p50_s"]),
        fmt(s["latency_p99_s"]),
        fmt(s["drain_s"], digits=1),
        f"{fmt(probe['waiting_median'], digits=0)} / {fmt(probe['waiting_max'], digits=0)}",
    )


def poisson_section(results: dict[str, Any], meta: dict[str, Any]) -> list[str]:
    plan, prio = meta["plan"], results["priority"]
    if not results["poisson"]:
        return ["Not measured (--priority-only, or no capacity figure from the priority stack)."]
    return [
        f"Capacity (continuous batching, {plan['normal_clients']} closed-loop clients, "
        f"{plan['normal_tokens']} tokens a job): {prio['capacity_jobs_per_s']:.2f} jobs/s. Poisson arrivals "
        f"at {plan['load']:.0%} of it, {results['poisson_rate_jobs_per_s']:.2f} jobs/s for "
        f"{plan['poisson_s']:.0f} s ({results['poisson_arrivals']} jobs, seed {meta['seeds']['poisson']}), "
        "the same schedule and prompts on two fresh stacks that differ only in CONVEYOR_BATCHING. "
        "Throughput: first arrival to last completion.",
        "",
        "| batching | ok/submitted | jobs/s | tokens/s | TTFT p50 (ms) | TTFT p95 (ms) | TTFT p99 (ms) "
        "| latency p50 (s) | latency p99 (s) | drain (s) | waiting median / max |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *(poisson_row(mode, run) for mode, run in results["poisson"].items()),
        "",
        *(
            batch_line(f"{mode}, batches", run["batches"])
            for mode, run in results["poisson"].items()
            if "batches" in run
        ),
    ]


def notes(results: dict[str, Any], meta: dict[str, Any]) -> list[str]:
    lines = []
    loads = [("priority", results["priority"].get("load_average"))]
    loads += [(f"poisson {m}", r.get("load_average")) for m, r in results["poisson"].items()]
    lines.append(
        "- 1-minute load average at the start and end of each phase (2 cores, shared; other work skews "
        "absolute numbers, not ratios within a run): "
        + ", ".join(f"{name} {' -> '.join(f'{v:.1f}' for v in values)}" for name, values in loads if values)
    )
    errors = [f"- {name}: {error}" for name, s in summaries(results) for error in (s.get("errors") or [])]
    return lines + errors


def summaries(results: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    prio = results["priority"]
    found = [
        (f"priority {k}", prio[k])
        for k in ("high_unloaded", "high_saturated", "normal_saturated")
        if k in prio
    ]
    found += [(f"poisson {m}", r["summary"]) for m, r in results["poisson"].items() if "summary" in r]
    return found


def markdown(results: dict[str, Any], meta: dict[str, Any]) -> str:
    plan = meta["plan"]
    shortened = (
        "" if meta["default_plan"] else " Shortened or changed from the defaults: see the plan in the JSON."
    )
    lines = [
        f"# Scheduling benchmark ({meta['model']})",
        "",
        f"{meta['model']}, fp32, CPU ({meta['cpus']} cores), greedy, ignore_eos; {meta['started']}, commit "
        f"{meta['commit']}; {meta['bench_wall_s'] / 60:.1f} min in all.{shortened} TTFT and latency on the "
        "client's clock.",
        "",
        "## Priority under saturation",
        "",
        *priority_section(results["priority"], meta),
        "",
        "## Iteration-level (continuous) against request-level batching, Poisson load",
        "",
        *poisson_section(results, meta),
        "",
        "## Targets",
        "",
        *target_rows(targets(plan["load"]), ratios(results)),
        "",
        *notes(results, meta),
    ]
    return "\n".join(lines) + "\n"


def payload(results: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    return {
        "meta": meta,
        "targets": {t.key: t.goal for t in targets(meta["plan"]["load"])},
        "ratios": ratios(results),
        "results": results,
    }


# ---------------------------------------------------------------- main


def run_stack(
    name: str,
    model: Model,
    workdir: Path,
    *,
    batching: str,
    warm: list[Prompt],
    body: Callable[[System], Coroutine[Any, Any, dict[str, Any]]],
) -> tuple[dict[str, Any], dict[str, str]]:
    """Start a stack, warm it up, run `body` on it; {"error": ...} if the stack did not come up."""
    try:
        with conveyor(name, workdir, {"CONVEYOR_BATCHING": batching}, model=model) as system:
            warm_up(system, warm)
            return asyncio.run(body(system)), dict(system.env)
    except RuntimeError as exc:
        say(f"{name}: not measured: {exc}")
        return {"error": str(exc)}, {}


def parse(argv: list[str] | None) -> tuple[Plan, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--duration-s", type=float, default=Plan.duration_s, help="each high stream and the capacity window"
    )
    parser.add_argument(
        "--poisson-s", type=float, default=None, help="Poisson arrival window (default 2x duration)"
    )
    parser.add_argument("--ramp-s", type=float, default=Plan.ramp_s)
    parser.add_argument("--normal-clients", type=int, default=Plan.normal_clients)
    parser.add_argument("--load", type=float, default=Plan.load, help="Poisson rate / capacity")
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--priority-only", action="store_true", help="skip the Poisson comparison")
    args = parser.parse_args(argv)
    plan = Plan(
        duration_s=args.duration_s,
        poisson_s=args.poisson_s or 2 * args.duration_s,
        ramp_s=args.ramp_s,
        normal_clients=args.normal_clients,
        load=args.load,
    )
    return plan, args


def main(argv: list[str] | None = None) -> int:
    plan, args = parse(argv)
    terminate_on_sigterm()
    workdir = Path(tempfile.mkdtemp(prefix="conveyor-scheduling-"))
    model = chosen_model(args.model, workdir)
    if model is None:
        return 2
    tokenizer = AutoTokenizer.from_pretrained(model.path)
    normals = make_prompts(tokenizer, 64)
    highs = make_prompts(tokenizer, 16, seed=HIGH_SEED, user_tokens=SHORT_USER_TOKENS)
    meta: dict[str, Any] = {
        "model": model.name,
        "plan": asdict(plan),
        "default_plan": plan == Plan(),
        "cpus": os.cpu_count(),
        "commit": git_commit(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "logs": str(workdir),
        "normal_prompt_tokens": token_stats([len(p.ids) for p in normals]),
        "high_prompt_tokens": token_stats([len(p.ids) for p in highs]),
        "seeds": {"prompts": SEED, "high": HIGH_SEED, "poisson": POISSON_SEED},
    }
    say(f"scheduling benchmark, {model.name}, plan {asdict(plan)}; logs in {workdir}")
    started = time.perf_counter()
    prio, meta["priority_env"] = run_stack(
        "priority",
        model,
        workdir,
        batching="continuous",
        warm=normals,
        body=lambda s: priority_run(s, plan, highs, normals),
    )
    results: dict[str, Any] = {"priority": prio, "poisson": {}}
    capacity = prio.get("capacity_jobs_per_s") or 0.0
    rate = plan.load * capacity
    offsets = poisson_arrivals(rate, plan.poisson_s, POISSON_SEED)
    if offsets and not args.priority_only:
        prompts = cycled(normals, len(offsets))
        results["poisson_rate_jobs_per_s"], results["poisson_arrivals"] = rate, len(offsets)
        say(f"capacity {capacity:.2f} jobs/s; Poisson at {rate:.2f} jobs/s: {len(offsets)} arrivals")
        for mode in ("continuous", "request"):
            results["poisson"][mode], meta[f"poisson_{mode}_env"] = run_stack(
                f"poisson {mode}",
                model,
                workdir,
                batching=mode,
                warm=normals,
                body=lambda s: poisson_run(s, plan, prompts, offsets),
            )
    meta["bench_wall_s"] = time.perf_counter() - started
    text = markdown(results, meta)
    print(text)
    write_results("scheduling", text, payload(results, meta))
    failed = [r for r in (prio, *results["poisson"].values()) if "error" in r]
    return 1 if failed or not offsets else 0  # a missed target is a finding, not a failed run


if __name__ == "__main__":
    sys.exit(main())
