"""The scheduling benchmark's report: its tables, the ratios against their targets, and the JSON.

`ratios` derives the three target figures from the run's results; `target_rows` turns them into a
table with a verdict each; `markdown` writes the whole report, `payload` the JSON beside it.
"""

from __future__ import annotations

from typing import Any

from bench.report import fmt, ratio, verdict
from bench.scheduling_load import TTFT_HEADER, jobs_cell, ttft_row

TARGET_PRIORITY = 1.5  # high P95 TTFT saturated / unloaded, at most
TARGET_TTFT = 0.5  # P99 TTFT continuous / request, at most
TARGET_THROUGHPUT = 1.0  # throughput continuous / request, at least
NOISE = 0.05  # a throughput ratio this close under 1.0 is equal within this machine's noise


def ratios(results: dict[str, Any]) -> dict[str, float | None]:
    """High P95 TTFT saturated/unloaded; P99 TTFT and jobs/s continuous/request (None where missing)."""
    prio, poisson = results.get("priority", {}), results.get("poisson", {})
    unloaded = (prio.get("high_unloaded") or {}).get("ttft_p95_s")
    saturated = (prio.get("high_saturated") or {}).get("ttft_p95_s")
    cont = (poisson.get("continuous") or {}).get("summary") or {}
    req = (poisson.get("request") or {}).get("summary") or {}

    def of(a: float | None, b: float | None) -> float | None:
        return ratio(a, b) if a is not None and b is not None else None

    return {
        "high_p95_ttft_saturated_vs_unloaded": of(saturated, unloaded),
        "p99_ttft_continuous_vs_request": of(cont.get("ttft_p99_s"), req.get("ttft_p99_s")),
        "throughput_continuous_vs_request": of(cont.get("jobs_per_s"), req.get("jobs_per_s")),
    }


def throughput_verdict(value: float | None) -> str:
    if value is None:
        return "n/a"
    if value >= TARGET_THROUGHPUT:
        return "met"
    return "met (equal within noise)" if value >= TARGET_THROUGHPUT - NOISE else "missed"


def target_rows(r: dict[str, float | None]) -> list[str]:
    prio, ttft, tput = (
        r["high_p95_ttft_saturated_vs_unloaded"],
        r["p99_ttft_continuous_vs_request"],
        r["throughput_continuous_vs_request"],
    )
    return [
        "| target | value | goal | |",
        "|---|---:|---:|---|",
        f"| high P95 TTFT, saturated / unloaded | {fmt(prio)}x | <= {TARGET_PRIORITY}x "
        f"| {verdict(prio, TARGET_PRIORITY, False)} |",
        f"| P99 TTFT at {{load}} load, continuous / request | {fmt(ttft)}x | <= {TARGET_TTFT}x "
        f"| {verdict(ttft, TARGET_TTFT, False)} |",
        f"| throughput at {{load}} load, continuous / request | {fmt(tput)}x | >= {TARGET_THROUGHPUT}x "
        f"| {throughput_verdict(tput)} |",
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
    cells = [
        mode,
        jobs_cell(s),
        fmt(s["jobs_per_s"]),
        fmt(s["tokens_per_s"], digits=1),
        fmt(s["ttft_p50_s"], 1000, 0),
        fmt(s["ttft_p95_s"], 1000, 0),
        fmt(s["ttft_p99_s"], 1000, 0),
        fmt(s["latency_p50_s"]),
        fmt(s["latency_p99_s"]),
        fmt(s["drain_s"], digits=1),
        f"{fmt(probe['waiting_median'], digits=0)} / {fmt(probe['waiting_max'], digits=0)}",
    ]
    return "| " + " | ".join(cells) + " |"


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
    targets = [line.replace("{load}", f"{plan['load']:.0%}") for line in target_rows(ratios(results))]
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
        *targets,
        "",
        *notes(results, meta),
    ]
    return "\n".join(lines) + "\n"


def payload(results: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    return {
        "meta": meta,
        "targets": {
            "high_p95_ttft_saturated_vs_unloaded": TARGET_PRIORITY,
            "p99_ttft_continuous_vs_request": TARGET_TTFT,
            "throughput_continuous_vs_request": TARGET_THROUGHPUT,
        },
        "ratios": ratios(results),
        "results": results,
    }
