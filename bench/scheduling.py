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
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from bench.load import conveyor_job, load_client
from bench.processes import say, terminate_on_sigterm
from bench.prompts import SEED, Prompt, make_prompts
from bench.report import git_commit, token_stats, write_results
from bench.scheduling_load import (
    Timed,
    TokenLog,
    batch_stats,
    class_summary,
    closed_loop_until,
    cycled,
    open_loop,
    poisson_arrivals,
    throughput,
)
from bench.scheduling_report import markdown, payload
from bench.scheduling_stack import Model, Probe, Stack, batch_log, chosen_model, stack, warm_up

HIGH_SEED = SEED + 1  # the high stream's arrivals and prompts
POISSON_SEED = SEED + 2
SHORT_USER_TOKENS = (10, 30)  # the high jobs' user messages: short interactive requests


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


def loadavg() -> float:
    return os.getloadavg()[0]


# ---------------------------------------------------------------- experiments


async def priority_run(
    stack: Stack, plan: Plan, highs: list[Prompt], normals: list[Prompt]
) -> dict[str, Any]:
    """Phase A (high alone), phase B (high under normal saturation), phase C (normal alone: capacity)."""
    offsets = poisson_arrivals(plan.high_rate, plan.duration_s, HIGH_SEED)
    high_prompts = cycled(highs, len(offsets))
    high = conveyor_job(plan.high_tokens, priority="high")
    tokens = TokenLog()
    normal = conveyor_job(plan.normal_tokens, priority="normal", on_token=tokens.add)
    unloaded: list[Timed] = []
    loaded: list[Timed] = []
    normal_done: list[Timed] = []
    normal_submits: list[float] = []
    probe = Probe(stack)
    probing = asyncio.create_task(probe.run())
    load = [loadavg()]
    async with load_client(stack.base_url, plan.normal_clients + 32) as client:
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
    batches = await batch_log(stack)
    await stop_probe(probing)
    in_b = [t for t in normal_done if b_start <= t.submitted < b_end]
    b_tokens = tokens.between(b_start, b_end) / (b_end - b_start)
    c_tokens = tokens.between(b_end, c_end) / (c_end - b_end)
    return {
        "high_unloaded": class_summary(unloaded),
        "high_saturated": class_summary(loaded),
        "normal_saturated": class_summary(in_b, submitted=sum(b_start <= t < b_end for t in normal_submits)),
        "saturated_normal_tokens_per_s": b_tokens,
        "capacity_tokens_per_s": c_tokens,
        "capacity_jobs_per_s": c_tokens / plan.normal_tokens,
        "capacity_completions_per_s": sum(1 for t in normal_done if b_end <= t.ended < c_end)
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
        "jobs": [job_line(t, a_start, "unloaded") for t in unloaded]
        + [job_line(t, b_start, "saturated") for t in (*loaded, *in_b)],
    }


async def poisson_run(
    stack: Stack, plan: Plan, prompts: list[Prompt], offsets: list[float]
) -> dict[str, Any]:
    """Open-loop arrivals at `offsets`; waits for the last job, up to `drain_cap_s` after the last arrival."""
    done: list[Timed] = []
    probe = Probe(stack)
    probing = asyncio.create_task(probe.run())
    load = [loadavg()]
    job = conveyor_job(plan.normal_tokens)
    async with load_client(stack.base_url, 256) as client:
        start = time.perf_counter() + 0.2
        arrivals = open_loop(client, job, prompts, offsets, cls=stack.name, start=start, done=done)
        try:
            await asyncio.wait_for(arrivals, timeout=offsets[-1] + 0.2 + plan.drain_cap_s)
        except TimeoutError:
            say(
                f"{stack.name}: {len(offsets) - len(done)} jobs unfinished "
                f"{plan.drain_cap_s:.0f} s after the last arrival"
            )
        end = time.perf_counter()
    load.append(loadavg())
    batches = await batch_log(stack)
    await stop_probe(probing)
    summary = class_summary(done, submitted=len(offsets))
    summary.update(throughput(done, start))
    summary["drain_s"] = max(0.0, summary["span_s"] - offsets[-1])
    say(
        f"{stack.name}: {summary['ok']}/{len(offsets)} ok, {summary['jobs_per_s']:.2f} jobs/s, "
        f"TTFT p99 {summary['ttft_p99_s'] or 0:.2f} s"
    )
    return {
        "summary": summary,
        "probe": probe.window(start, end),
        "batches": batch_stats(batches, start, end),
        "load_average": load,
        "jobs": [job_line(t, start, "poisson") for t in done],
    }


async def stop_probe(probing: asyncio.Task[None]) -> None:
    """Cancel the probe and wait for it, briefly: a Redis client cancelled mid-command may not close."""
    probing.cancel()
    await asyncio.wait({probing}, timeout=5.0)


def job_line(t: Timed, origin: float, phase: str) -> dict[str, Any]:
    """One job for the JSON: its phase and class, submit time from the phase's start, its result."""
    record = {k: v for k, v in asdict(t.job).items() if k != "token_ids"}
    return {"phase": phase, "class": t.cls, "submitted_s": t.submitted - origin, **record}


# ---------------------------------------------------------------- main


def run_stack(
    name: str,
    model: Model,
    workdir: Path,
    *,
    batching: str,
    warm: list[Prompt],
    body: Callable[[Stack], Coroutine[Any, Any, dict[str, Any]]],
) -> tuple[dict[str, Any], dict[str, str]]:
    """Start a stack, warm it up, run `body` on it; {"error": ...} if the stack did not come up."""
    try:
        with stack(name, model, workdir, {"CONVEYOR_BATCHING": batching}) as s:
            asyncio.run(warm_up(s, warm))
            return asyncio.run(body(s)), s.env
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
