"""What a benchmark reports: per-system summaries, percentiles and ratios, the Markdown table, result files.

`SystemRun` holds one system's jobs and wall time and sums them up (throughput over the whole run,
P50/P99 latency, P50 TTFT); `system_table` renders runs as a Markdown table and `write_results` writes
a report and its JSON next to each other. `derived`, `markdown` and `results_payload` are the slice
benchmark's own figures, targets and files.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.load import JobResult
from bench.processes import ROOT, say

RESULTS_DIR = ROOT / "bench" / "results"

TARGET_VS_NAIVE = 3.8  # conveyor c32 throughput / naive c32 throughput, at least
TARGET_VS_RAW = 0.7  # conveyor c32 throughput / raw b32 throughput, at least
TARGET_TTFT_OVERHEAD_MS = 30.0  # conveyor c1 P50 TTFT - raw prefill, at most


@dataclass
class SystemRun:
    name: str
    jobs: list[JobResult]
    wall_s: float
    note: str = ""
    load: tuple[float, float] = (0.0, 0.0)  # the machine's 1-minute load average at start and end

    @property
    def ok_jobs(self) -> list[JobResult]:
        return [j for j in self.jobs if j.ok]

    def tokens_per_s(self) -> float:
        return sum(j.tokens for j in self.ok_jobs) / self.wall_s if self.wall_s > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        ok = self.ok_jobs
        ttfts = [j.ttft_s for j in ok if j.ttft_s is not None]
        return {
            "jobs": len(self.jobs),
            "succeeded": len(ok),
            "failed": len(self.jobs) - len(ok),
            "tokens": sum(j.tokens for j in ok),
            "wall_s": self.wall_s,
            "tokens_per_s": self.tokens_per_s(),
            "p50_latency_s": percentile([j.latency_s for j in ok], 50),
            "p99_latency_s": percentile([j.latency_s for j in ok], 99),
            "p50_ttft_s": percentile(ttfts, 50),
            "errors": sorted({j.error for j in self.jobs if j.error}),
        }


# ---------------------------------------------------------------- figures


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def greedy_agreement(reference: SystemRun, other: SystemRun, eos_ids: set[int]) -> dict[str, int]:
    """Jobs whose tokens equal the reference's up to the first EOS (ignore_eos may emit one; min_new_tokens
    never does)."""
    ref = {j.prompt: j.token_ids for j in reference.ok_jobs}
    same = compared = 0
    for job in other.ok_jobs:
        if job.prompt not in ref or not job.token_ids:
            continue
        cut = next((i for i, t in enumerate(job.token_ids) if t in eos_ids), len(job.token_ids))
        compared += 1
        same += job.token_ids[:cut] == ref[job.prompt][:cut]
    return {"compared": compared, "identical": same}


def token_stats(values: Sequence[int]) -> str:
    return f"min {min(values)}, median {statistics.median(values):g}, max {max(values)}"


def derived(
    runs: Mapping[str, SystemRun], prefill: dict[str, Any], eos_ids: set[int], *, concurrency: int, batch: int
) -> dict[str, Any]:
    """The slice's figures: throughput ratios, TTFT against the raw prefill, Conveyor's batch sizes."""
    c1, c32 = runs["conveyor c1"], runs[f"conveyor c{concurrency}"]
    naive, raw32 = runs[f"naive server c{concurrency}"], runs[f"raw generate b{batch}"]
    c1_ttft = percentile([j.ttft_s for j in c1.ok_jobs if j.ttft_s is not None], 50)
    server_ttft = percentile([j.server_ttft_s for j in c1.ok_jobs if j.server_ttft_s is not None], 50)
    batches = {j.batch_id: j.batch_size for j in c32.ok_jobs if j.batch_id and j.batch_size}
    sizes = sorted(batches.values())
    job_sizes = [j.batch_size for j in c32.ok_jobs if j.batch_size]
    return {
        "conveyor_vs_naive": ratio(c32.tokens_per_s(), naive.tokens_per_s()),
        "conveyor_vs_raw_b32": ratio(c32.tokens_per_s(), raw32.tokens_per_s()),
        "raw_prefill": prefill,
        "conveyor_c1_p50_ttft_s": c1_ttft,
        "ttft_overhead_s": c1_ttft - prefill["seconds"] if c1_ttft is not None else None,
        "conveyor_c1_p50_server_ttft_s": server_ttft,
        "conveyor_c32_p50_server_ttft_s": percentile(
            [j.server_ttft_s for j in c32.ok_jobs if j.server_ttft_s is not None], 50
        ),
        "conveyor_c32_mean_batch_size": statistics.fmean(sizes) if sizes else None,
        "conveyor_c32_job_weighted_batch_size": statistics.fmean(job_sizes) if job_sizes else None,
        "conveyor_c32_batch_sizes": sizes,
        "greedy_agreement_c1_vs_raw_b1": greedy_agreement(runs["raw generate b1"], c1, eos_ids),
    }


# ---------------------------------------------------------------- markdown


def fmt(value: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value * scale:.{digits}f}"


def verdict(value: float | None, target: float, at_least: bool) -> str:
    if value is None:
        return "n/a"
    return "met" if (value >= target if at_least else value <= target) else "missed"


def table_row(run: SystemRun) -> str:
    s = run.summary()
    jobs = str(s["succeeded"]) if not s["failed"] else f"{s['succeeded']}/{s['jobs']} ({s['failed']} failed)"
    cells = [
        run.name,
        jobs,
        fmt(s["tokens_per_s"], digits=1),
        fmt(s["p50_latency_s"]),
        fmt(s["p99_latency_s"]),
        fmt(s["p50_ttft_s"], 1000, 1),
    ]
    return "| " + " | ".join(cells) + " |"


def system_table(runs: Sequence[SystemRun]) -> list[str]:
    """One row per system: jobs, throughput, P50/P99 latency, P50 TTFT."""
    return [
        "| system | jobs | tokens/s | p50 latency (s) | p99 latency (s) | p50 TTFT (ms) |",
        "|---|---:|---:|---:|---:|---:|",
        *(table_row(run) for run in runs),
    ]


def failure_lines(runs: Sequence[SystemRun]) -> list[str]:
    return [f"- {run.name} failure: {error}" for run in runs for error in run.summary()["errors"]]


def target_table(extra: dict[str, Any]) -> list[str]:
    vs_naive, vs_raw = extra["conveyor_vs_naive"], extra["conveyor_vs_raw_b32"]
    overhead = extra["ttft_overhead_s"]
    overhead_ms = None if overhead is None else overhead * 1000
    return [
        "| target | value | goal | |",
        "|---|---:|---:|---|",
        f"| conveyor c32 / naive c32 throughput | {fmt(vs_naive)}x | >= {TARGET_VS_NAIVE}x "
        f"| {verdict(vs_naive, TARGET_VS_NAIVE, True)} |",
        f"| conveyor c32 / raw b32 throughput | {fmt(vs_raw)}x | >= {TARGET_VS_RAW}x "
        f"| {verdict(vs_raw, TARGET_VS_RAW, True)} |",
        f"| conveyor c1 p50 TTFT - raw prefill | {fmt(overhead, 1000, 1)} ms "
        f"| <= {TARGET_TTFT_OVERHEAD_MS:.0f} ms "
        f"| {verdict(overhead_ms, TARGET_TTFT_OVERHEAD_MS, False)} |",
    ]


def slice_notes(
    runs: Sequence[SystemRun], extra: dict[str, Any], meta: dict[str, Any], prefill_runs: int
) -> list[str]:
    prefill, agreement = extra["raw_prefill"], extra["greedy_agreement_c1_vs_raw_b1"]
    return [
        f"- raw prefill, batch 1, prompt of {prefill['prompt_tokens']} tokens (median of {prefill_runs}): "
        f"{fmt(prefill['seconds'], 1000, 1)} ms",
        f"- conveyor c1 p50 TTFT: client {fmt(extra['conveyor_c1_p50_ttft_s'], 1000, 1)} ms, server "
        f"(first_token_at - created_at) {fmt(extra['conveyor_c1_p50_server_ttft_s'], 1000, 1)} ms",
        f"- conveyor c32 mean batch size: {fmt(extra['conveyor_c32_mean_batch_size'], digits=1)} over "
        f"{len(extra['conveyor_c32_batch_sizes'])} batches (sizes {extra['conveyor_c32_batch_sizes']}; "
        f"mean over jobs {fmt(extra['conveyor_c32_job_weighted_batch_size'], digits=1)})",
        "- 1-minute load average at the start and end of each system (2 cores; other work skews results): "
        + ", ".join(f"{r.name} {r.load[0]:.1f}-{r.load[1]:.1f}" for r in runs),
        f"- greedy agreement, conveyor c1 vs raw b1: {agreement['identical']}/"
        f"{agreement['compared']} identical",
        f"- prompt tokens (chat-templated): {meta['prompt_tokens']}; "
        f"user message tokens: {meta['user_tokens']}",
    ]


def markdown(
    runs: Sequence[SystemRun], extra: dict[str, Any], meta: dict[str, Any], *, prefill_runs: int
) -> str:
    """The slice report: the system table, the targets, the notes behind them, any failures."""
    lines = [
        f"# Conveyor slice benchmark ({meta['mode']})",
        "",
        f"{meta['model']}, fp32, CPU ({meta['cpus']} cores, torch threads {meta['torch_threads']}), greedy, "
        f"{meta['max_tokens']} tokens per job; {meta['started']}, commit {meta['commit']}.",
        "",
        *system_table(runs),
        "",
        *target_table(extra),
        "",
        *slice_notes(runs, extra, meta, prefill_runs),
        *failure_lines(runs),
    ]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- files


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


def report_run(run: SystemRun) -> None:
    say(
        f"{run.name}: {len(run.ok_jobs)}/{len(run.jobs)} jobs in {run.wall_s:.1f} s, "
        f"{run.tokens_per_s():.1f} tokens/s (load average {run.load[0]:.2f} -> {run.load[1]:.2f})"
    )


def job_record(job: JobResult) -> dict[str, Any]:
    record = asdict(job)
    record.pop("token_ids")
    return record


def systems_record(runs: Sequence[SystemRun]) -> dict[str, Any]:
    """Each system's summary, note, load average and jobs (without their token ids), by name."""
    return {
        run.name: {
            **run.summary(),
            "note": run.note,
            "load_average": list(run.load),
            "jobs_detail": [job_record(j) for j in run.jobs],
        }
        for run in runs
    }


def results_payload(runs: Sequence[SystemRun], extra: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """The slice's JSON: the run's metadata, the targets, the derived figures, every system."""
    return {
        "meta": meta,
        "targets": {
            "conveyor_vs_naive": TARGET_VS_NAIVE,
            "conveyor_vs_raw_b32": TARGET_VS_RAW,
            "ttft_overhead_ms": TARGET_TTFT_OVERHEAD_MS,
        },
        "derived": extra,
        "systems": systems_record(runs),
    }


def in_process_meta(command: str) -> dict[str, str]:
    """What an in-process benchmark's report says about its run: the command, torch, when, the
    commit (CONVEYOR_COMMIT) and the load average at the end."""
    import os
    import time

    import torch

    return {
        "command": command,
        "torch": torch.__version__,
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": os.environ.get("CONVEYOR_COMMIT", ""),
        "load": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


def write_results(name: str, text: str, payload: dict[str, Any], directory: Path = RESULTS_DIR) -> None:
    """`text` to `<name>.md` and `payload` to `<name>.json`, in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.md").write_text(text)
    (directory / f"{name}.json").write_text(json.dumps(payload, indent=2) + "\n")
    say(f"wrote {directory / f'{name}.md'} and {directory / f'{name}.json'}")
