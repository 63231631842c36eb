"""The suite's report: the target ratios with a verdict each, the tables, the notes, and the JSON.

`ratios` derives every target figure from the run's results (None where a system was not measured);
`target_rows` turns them into the verdict table; `markdown` writes the whole report, `payload` the JSON.
The ratio and verdict logic is unit-tested on hand-made results.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bench.report import fmt, ratio, verdict
from bench.suite_systems import CONVEYOR_1, CONVEYOR_2, NAIVE, RAY, SYSTEMS


@dataclass(frozen=True)
class Target:
    key: str
    label: str
    goal: float
    at_least: bool  # the value must be >= goal (else <= goal)
    unit: str = "x"


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
    Target("burst lost jobs", "burst: accepted jobs lost (failed or unfinished)", 0, False, unit=""),
]


def point(results: dict[str, Any], name: str, rate: float) -> dict[str, Any] | None:
    system = results.get("systems", {}).get(name) or {}
    return (system.get("points") or {}).get(str(rate))


def of(a: float | None, b: float | None) -> float | None:
    return ratio(a, b) if a is not None and b is not None else None


def ratios(results: dict[str, Any], main_rate: float) -> dict[str, float | None]:
    """Every target's value from the results; None where a figure is missing."""
    out: dict[str, float | None] = {}
    naive, ray = point(results, NAIVE, main_rate), point(results, RAY, main_rate)
    for name in (CONVEYOR_1, CONVEYOR_2):
        mine = point(results, name, main_rate)
        for other, key in ((naive, "naive"), (ray, "ray")):
            out[f"{name}: throughput vs {key}"] = (
                of(mine["tokens_per_s"], other["tokens_per_s"]) if mine and other else None
            )
            out[f"{name}: p99 vs {key}"] = (
                of(mine["latency_p99_all_s"], other["latency_p99_all_s"]) if mine and other else None
            )
    conveyor = results.get("systems", {}).get(CONVEYOR_1) or {}
    raw_best = max((r["tokens_per_s"] for r in (results.get("raw") or {}).values()), default=None)
    peak = (conveyor.get("peak") or {}).get("tokens_per_s")
    out["peak vs raw"] = of(peak, raw_best)
    burst = conveyor.get("burst")
    if burst:
        high = burst["high"]
        out["burst high p95 wait"] = of(high["during"]["p95_s"], high["before"]["p95_s"])
        out["burst lost jobs"] = float(
            sum(burst[c]["counts"]["failed"] + burst[c]["counts"]["unfinished"] for c in ("normal", "high"))
        )
    else:
        out["burst high p95 wait"] = out["burst lost jobs"] = None
    return out


def target_rows(values: dict[str, float | None]) -> list[str]:
    rows = ["| target | value | goal | |", "|---|---:|---:|---|"]
    for t in TARGETS:
        value = values.get(t.key)
        shown = fmt(value, digits=0 if not t.unit else 2)
        goal = f"{'>=' if t.at_least else '<='} {t.goal:g}{t.unit}"
        rows.append(
            f"| {t.label} | {shown}{t.unit if value is not None else ''} | {goal} "
            f"| {verdict(value, t.goal, t.at_least)} |"
        )
    return rows


# ---------------------------------------------------------------- tables


def jobs_cell(f: dict[str, Any]) -> str:
    extra = [f"{f[k]} {k}" for k in ("refused", "failed", "unfinished") if f.get(k)]
    return f"{f['ok']}/{f['jobs']}" + (f" ({', '.join(extra)})" if extra else "")


def load_cell(values: list[float] | None) -> str:
    return " -> ".join(f"{v:.1f}" for v in values) if values else "n/a"


def main_rows(results: dict[str, Any], rate: float) -> list[str]:
    rows = [
        "| system | ok/submitted | tokens/s | latency p50 (s) | p99, done (s) | p99 with unfinished (s) "
        "| TTFT p50 (s) | ITL p50 (ms) | load average |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in SYSTEMS:
        if name not in results.get("systems", {}):
            continue
        f = point(results, name, rate)
        if f is None:
            rows.append(f"| {name} | not measured | | | | | | | |")
            continue
        cells = [
            name,
            jobs_cell(f),
            fmt(f["tokens_per_s"], digits=1),
            fmt(f["latency_p50_s"]),
            fmt(f["latency_p99_s"]),
            fmt(f["latency_p99_all_s"]),
            fmt(f["ttft_p50_s"]),
            fmt(f["itl_p50_s"], 1000, 0) if f["itl_p50_s"] is not None else "(not streamed)",
            load_cell(f.get("load_average")),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def sweep_rows(results: dict[str, Any], rates: list[float]) -> list[str]:
    rows = [
        "| system | jobs/s | tokens/s asked | ok/submitted | tokens/s | p99 with unfinished (s) "
        "| load average |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in SYSTEMS:
        for rate in rates:
            f = point(results, name, rate)
            if f is None:
                continue
            cells = [
                name,
                f"{rate:g}",
                fmt(f["offered_tokens_per_s"], digits=1),
                jobs_cell(f),
                fmt(f["tokens_per_s"], digits=1),
                fmt(f["latency_p99_all_s"]),
                load_cell(f.get("load_average")),
            ]
            rows.append("| " + " | ".join(cells) + " |")
    return rows


def peak_rows(results: dict[str, Any], meta: dict[str, Any]) -> list[str]:
    rows = ["| system | tokens/s | how | load average |", "|---|---:|---|---:|"]
    for name, r in (results.get("raw") or {}).items():
        how = f"{r['jobs']} prompts, {r['jobs'] // r['batch']} `generate` call(s) of {r['batch']}, 64 tokens"
        rows.append(
            f"| {name} | {fmt(r['tokens_per_s'], digits=1)} | {how} | {load_cell(r['load_average'])} |"
        )
    peak = (results.get("systems", {}).get(CONVEYOR_1) or {}).get("peak")
    if peak:
        opens = meta["plan"]["peak_ramp_s"] + meta["plan"]["peak_warm_s"]
        how = (
            f"{peak['clients']} closed-loop clients (64 tokens a job), tokens received over "
            f"{peak['window_s']:.0f} s from {opens:.0f} s after the first ({peak['jobs_ended']} jobs ended, "
            f"{peak['failed']} failed)"
        )
        rows.append(
            f"| {CONVEYOR_1} | {fmt(peak['tokens_per_s'], digits=1)} | {how} | {load_cell(peak['load'])} |"
        )
    return rows


def burst_rows(burst: dict[str, Any]) -> list[str]:
    rows = [
        "| class | arrivals | phase | jobs | queue wait median (ms) | queue wait p95 (ms) |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for cls in ("high", "normal"):
        for phase in ("before", "during", "after"):
            s = burst[cls][phase]
            rows.append(
                f"| {cls} | {burst[cls]['arrivals']} | {phase} | {s['jobs']} | {fmt(s['median_s'], 1000, 0)} "
                f"| {fmt(s['p95_s'], 1000, 0)} |"
            )
    return rows


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
        *target_rows(ratios(results, main)),
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
