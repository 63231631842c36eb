"""What a benchmark reports: the figures of its runs, targets with a verdict each, tables, result files.

Figures of jobs and runs (bench/load.py's records): `summary` of a closed-loop run (throughput over
its wall time, P50/P99 latency, P50 TTFT), `throughput` from the first arrival to the last end,
`job_figures` of an open-loop run (unfinished jobs counted at the time they had waited), queue waits
and ITL. Every driver renders its tables here: `table` (a header, its columns' alignment, the rows)
and `target_rows`, the one verdict table (a `Target` is a figure's goal). `write_results` writes a
report and its JSON side by side; `git_commit` names the tree measured.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.load import JobResult, Run
from bench.systems import ROOT, say

RESULTS_DIR = ROOT / "bench" / "results"


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b; None without both, or without a positive denominator."""
    return a / b if a is not None and b is not None and b > 0 else None


def fmt(value: float | None, scale: float = 1.0, digits: int = 2, missing: str = "n/a") -> str:
    return missing if value is None else f"{value * scale:.{digits}f}"


def token_stats(values: Sequence[int]) -> str:
    return f"min {min(values)}, median {statistics.median(values):g}, max {max(values)}"


def load_cell(values: Sequence[float] | None) -> str:
    """A load average's samples, `before -> after`."""
    return " -> ".join(f"{v:.1f}" for v in values) if values else "n/a"


def row(*cells: object) -> str:
    """One Markdown table row."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def table(columns: str, rows: Iterable[Sequence[object]]) -> list[str]:
    """A Markdown table: its header's cells `|` apart (a name ending in `>` is a right-aligned column,
    shown without the `>`), then a line per row."""
    names = [name.strip() for name in columns.split("|")]
    rule = "|".join("---:" if name.endswith(">") else "---" for name in names)
    return [row(*(name.removesuffix(">") for name in names)), f"|{rule}|", *(row(*cells) for cells in rows)]


def median_ms(samples: Sequence[float]) -> float:
    """The median of timings in seconds, in milliseconds (the in-process micro-benchmarks' figure)."""
    return statistics.median(samples) * 1000


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of `fn` took."""
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


@dataclass(frozen=True)
class Target:
    key: str
    label: str
    goal: float
    at_least: bool  # the value must be >= goal (else <= goal)
    unit: str = "x"
    scale: float = 1.0  # the value is shown and judged times this (seconds as ms: 1000)
    digits: int = 2


def verdict(value: float | None, goal: float, at_least: bool) -> str:
    if value is None:
        return "n/a"
    return "met" if (value >= goal if at_least else value <= goal) else "missed"


def target_rows(targets: Sequence[Target], values: Mapping[str, float | None]) -> list[str]:
    """| target | value | goal | verdict |, a row per target (n/a where its figure is missing)."""
    cells = []
    for t in targets:
        raw = values.get(t.key)
        value = None if raw is None else raw * t.scale
        shown = fmt(value, digits=t.digits) + (t.unit if value is not None else "")
        goal = f"{'>=' if t.at_least else '<='} {t.goal}{t.unit}"
        cells.append((t.label, shown, goal, verdict(value, t.goal, t.at_least)))
    return table("target | value> | goal> | ", cells)


def summary(run: Run) -> dict[str, Any]:
    """Counts, throughput over the wall time, P50/P99 latency and P50 TTFT of the jobs that succeeded."""
    ok = run.ok
    ttfts = [j.ttft_s for j in ok if j.ttft_s is not None]
    return {
        "jobs": len(run.jobs),
        "succeeded": len(ok),
        "failed": len(run.jobs) - len(ok),
        "tokens": sum(j.tokens for j in ok),
        "wall_s": run.wall_s,
        "tokens_per_s": run.tokens_per_s(),
        "p50_latency_s": percentile([j.latency_s for j in ok], 50),
        "p99_latency_s": percentile([j.latency_s for j in ok], 99),
        "p50_ttft_s": percentile(ttfts, 50),
        "errors": sorted({j.error for j in run.jobs if j.error}),
    }


def report_run(run: Run) -> None:
    say(
        f"{run.name}: {len(run.ok)}/{len(run.jobs)} jobs in {run.wall_s:.1f} s, "
        f"{run.tokens_per_s():.1f} tokens/s (load average {run.load[0]:.2f} -> {run.load[1]:.2f})"
    )


def greedy_agreement(reference: Run, other: Run, eos_ids: set[int]) -> dict[str, int]:
    """Jobs whose tokens equal the reference's up to the first EOS (ignore_eos may emit one; min_new_tokens
    never does)."""
    ref = {j.prompt: j.token_ids for j in reference.ok}
    same = compared = 0
    for job in other.ok:
        if job.prompt not in ref or not job.token_ids:
            continue
        cut = next((i for i, t in enumerate(job.token_ids) if t in eos_ids), len(job.token_ids))
        compared += 1
        same += job.token_ids[:cut] == ref[job.prompt][:cut]
    return {"compared": compared, "identical": same}


def counts(jobs: Sequence[JobResult], submitted: int | None = None) -> dict[str, int]:
    """Jobs (submitted: the ended ones unless given), ok, refused, failed, unfinished, tokens of the ok."""
    ok = [j for j in jobs if j.ok]
    refused = sum(1 for j in jobs if j.refused)
    return {
        "jobs": len(jobs) if submitted is None else submitted,
        "ok": len(ok),
        "refused": refused,
        "failed": len(jobs) - len(ok) - refused,
        "unfinished": 0 if submitted is None else submitted - len(jobs),
        "tokens": sum(j.tokens for j in ok),
    }


def errors(jobs: Sequence[JobResult]) -> list[str]:
    return sorted({j.error for j in jobs if j.error and not j.refused})


def jobs_cell(s: Mapping[str, Any]) -> str:
    """`ok/submitted`, with the refused, failed and unfinished jobs when there are any."""
    extra = [f"{s[k]} {k}" for k in ("refused", "failed", "unfinished") if s.get(k)]
    return f"{s['ok']}/{s['jobs']}" + (f" ({', '.join(extra)})" if extra else "")


def throughput(jobs: Sequence[JobResult], start: float) -> dict[str, Any]:
    """Jobs/s and tokens/s of the successful jobs from `start` (the first arrival) to the last end."""
    ok = [j for j in jobs if j.ok]
    span = max(j.ended for j in ok) - start if ok else 0.0
    return {
        "span_s": span,
        "jobs_per_s": len(ok) / span if span > 0 else 0.0,
        "tokens_per_s": sum(j.tokens for j in ok) / span if span > 0 else 0.0,
    }


def unfinished_waits(run: Run) -> list[float]:
    """The jobs of an open-loop run that never ended: each one's time in the system when the run gave
    up (a lower bound on its latency). Prompt indices identify jobs: a run's prompts are distinct."""
    ended = {j.prompt for j in run.jobs}
    return [
        run.end - (run.start + offset)
        for prompt, offset in zip(run.prompts, run.offsets, strict=True)
        if prompt.index not in ended
    ]


def itl_s(job: JobResult) -> float | None:
    """Mean inter-token latency of a streamed job: (latency - TTFT) / (tokens - 1); None unstreamed."""
    if not job.ok or job.ttft_s is None or job.tokens < 2 or job.ttft_s >= job.latency_s:
        return None
    return (job.latency_s - job.ttft_s) / (job.tokens - 1)


def job_figures(run: Run) -> dict[str, Any]:
    """An open-loop run's counts, throughput (tokens of successful jobs / first arrival to last completion),
    latency percentiles of the jobs that succeeded, and P99 over those plus the unfinished at their waits."""
    ok = run.ok
    waits = unfinished_waits(run)
    latencies = [j.latency_s for j in ok]
    first = run.start + min(run.offsets) if run.offsets else run.start
    ttfts = [j.ttft_s for j in ok if j.ttft_s is not None]
    itls = [v for v in (itl_s(j) for j in ok) if v is not None]
    figures = {**counts(run.jobs, len(run.offsets)), "unfinished": len(waits)}
    span = throughput(run.jobs, first)["span_s"]
    return {
        **figures,
        "span_s": span,
        "tokens_per_s": figures["tokens"] / span if span > 0 else 0.0,
        "latency_p50_s": percentile(latencies, 50),
        "latency_p99_s": percentile(latencies, 99),
        "latency_p99_all_s": percentile(latencies + waits, 99),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "itl_p50_s": percentile(itls, 50),
        "itl_p99_s": percentile(itls, 99),
        "waited_s": run.end - first,
        "load_average": list(run.load),
        "errors": errors(run.jobs),
    }


def queue_wait_s(job: JobResult) -> float | None:
    """started_at - created_at: the time a job waited anywhere (intake, broker, the step in progress)
    before its prefill began. None without the job's timings."""
    if "intake" not in job.phases_s or "handoff" not in job.phases_s:
        return None
    return job.phases_s["intake"] + job.phases_s["handoff"]


def queue_waits(run: Run) -> list[tuple[float, float]]:
    """(submit time from the run's start, queue wait) of each job that succeeded."""
    return sorted((j.submitted - run.start, wait) for j in run.ok if (wait := queue_wait_s(j)) is not None)


def wait_stats(waits: Sequence[tuple[float, float]], start: float, end: float) -> dict[str, Any]:
    """Median and P95 queue wait of the jobs submitted in [start, end)."""
    inside = [w for at, w in waits if start <= at < end]
    return {"jobs": len(inside), "median_s": percentile(inside, 50), "p95_s": percentile(inside, 95)}


def job_rows(run: Run) -> list[dict[str, Any]]:
    """Every job of an open-loop run for the JSON: its class, submit time from the run's start, its
    figures and status; the unfinished ones too."""
    rows = [
        {
            "class": j.cls,
            "prompt": j.prompt,
            "submitted_s": round(j.submitted - run.start, 4),
            "status": "succeeded" if j.ok else ("refused" if j.refused else "failed"),
            "tokens": j.tokens,
            "latency_s": j.latency_s,
            "ttft_s": j.ttft_s,
            "itl_s": itl_s(j),
            "queue_wait_s": queue_wait_s(j),
            "error": j.error,
        }
        for j in sorted(run.jobs, key=lambda j: j.submitted)
    ]
    ended = {j.prompt for j in run.jobs}
    rows += [
        {"class": run.name, "prompt": p.index, "submitted_s": round(o, 4), "status": "unfinished"}
        for p, o in zip(run.prompts, run.offsets, strict=True)
        if p.index not in ended
    ]
    return rows


def git_commit() -> str:
    """The short commit of the repository, `+dirty` with uncommitted changes to tracked files."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return f"{out}{'+dirty' if dirty else ''}"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def write_results(
    name: str, text: str, payload: dict[str, Any] | None, directory: Path = RESULTS_DIR
) -> None:
    """`text` to `<name>.md` and `payload` (unless None) to `<name>.json`, in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.md").write_text(text)
    written = [directory / f"{name}.md"]
    if payload is not None:
        (directory / f"{name}.json").write_text(json.dumps(payload, indent=2) + "\n")
        written.append(directory / f"{name}.json")
    say(f"wrote {' and '.join(map(str, written))}")
