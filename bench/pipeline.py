"""Pipelining against replication on one CPU: what a 2-stage pipeline costs and what it buys.

Three Conveyor stacks, one after another, on the same seeded prompts (32 closed-loop clients,
every job 64 new tokens, SmolLM2-135M-Instruct, fp32):

    pipeline 2x1t    `conveyor up --stages 2`, each stage worker pinned to 1 torch thread
    replicas 2x1t    `conveyor up --replicas 2`, two whole-model workers of 1 thread each
    single 1x2t      `conveyor up`, one whole-model worker with torch's default threads (2)

It prints tokens/s, P50/P99 latency, each stage worker's resident memory and parameter bytes, and
the ratio pipeline / replicas (target >= 0.9: pipelining must cost no more than replication).

    .venv/bin/python -m bench.pipeline [--quick]

Writes bench/results/pipeline.md and bench/results/pipeline.json.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from transformers import AutoTokenizer

from bench.load import Run, closed_run
from bench.prompts import Prompt, make_prompts
from bench.report import failed, fmt, git_commit, report_run, summary, verdict, write_results
from bench.systems import MODEL_DIR, MODEL_NAME, conveyor, say, terminate_on_sigterm, warm_up

MAX_TOKENS = 64
CONCURRENCY = 32
TARGET_VS_REPLICAS = 0.9
PARAMS_LINE = re.compile(
    r"stage (\d+)/\d+ of .*: layers (\d+)-(\d+) on \S+(?: in \S+)?, ([\d.]+) MiB of parameters"
)


@dataclass(frozen=True)
class Layout:
    name: str
    args: list[str]
    env: dict[str, str]


LAYOUTS = [
    Layout("pipeline 2x1t", ["--stages", "2"], {"CONVEYOR_TORCH_THREADS": "1"}),
    Layout("replicas 2x1t", ["--replicas", "2"], {"CONVEYOR_TORCH_THREADS": "1"}),
    Layout("single 1x2t", [], {}),
]


def worker_memory(up_pid: int) -> list[dict[str, Any]]:
    """Resident memory of each stage worker under the `conveyor up` process."""
    workers = []
    for child in psutil.Process(up_pid).children():
        try:
            line = child.cmdline()
            if "worker" in line and "--embedding" not in line:
                stage = int(line[line.index("--stage") + 1])
                workers.append({"stage": stage, "rss_mib": child.memory_info().rss / 2**20})
        except (psutil.Error, ValueError):
            continue
    return sorted(workers, key=lambda w: w["stage"])


def parameter_lines(log: Path) -> list[dict[str, Any]]:
    found = [m.groups() for m in PARAMS_LINE.finditer(log.read_text(errors="replace"))]
    return [{"stage": int(s), "layers": f"{a}-{b}", "param_mib": float(mib)} for s, a, b, mib in found]


def measure(layout: Layout, prompts: list[Prompt], workdir: Path) -> tuple[Run, dict[str, Any]]:
    with conveyor(layout.name, workdir, layout.env, args=layout.args) as system:
        warm_up(system, prompts)
        run = closed_run(layout.name, system.base_url, system.make(MAX_TOKENS), prompts, CONCURRENCY)
        assert system.process is not None
        memory = worker_memory(system.process.pid)
    report_run(run)
    return run, {"workers": memory, "parameters": parameter_lines(system.log)}


def markdown(runs: list[Run], details: dict[str, dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        f"# Pipeline against replication ({meta['mode']})",
        "",
        f"{MODEL_NAME}, fp32, CPU ({meta['cpus']} cores), {CONCURRENCY} closed-loop clients, "
        f"{MAX_TOKENS} tokens per job; {meta['started']}, commit {meta['commit']}.",
        "",
        "| layout | jobs ok | tokens/s | p50 latency (s) | p99 latency (s) "
        "| workers: stage, layers, params MiB, RSS MiB |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for run in runs:
        s = summary(run)
        d = details[run.name]
        params = {p["stage"]: p for p in d["parameters"]}
        workers = "; ".join(
            f"{w['stage']}: {params.get(w['stage'], {}).get('layers', '?')}, "
            f"{params.get(w['stage'], {}).get('param_mib', 0):.0f}, {w['rss_mib']:.0f}"
            for w in d["workers"]
        )
        lines.append(
            f"| {run.name} | {s['succeeded']}/{s['jobs']} | {s['tokens_per_s']:.1f} | "
            f"{fmt(s['p50_latency_s'])} | {fmt(s['p99_latency_s'])} | {workers} |"
        )
    by_name = {r.name: r.tokens_per_s() for r in runs}
    ratio = by_name["pipeline 2x1t"] / by_name["replicas 2x1t"] if by_name["replicas 2x1t"] else 0.0
    single = by_name["pipeline 2x1t"] / by_name["single 1x2t"] if by_name["single 1x2t"] else 0.0
    lines += [
        "",
        f"- pipeline / replicas throughput: {ratio:.2f}x "
        f"(target >= {TARGET_VS_REPLICAS}x, {verdict(ratio, TARGET_VS_REPLICAS, True)})",
        f"- pipeline / single 2-thread process throughput: {single:.2f}x",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="32 jobs per layout instead of 64")
    quick = parser.parse_args(argv).quick
    terminate_on_sigterm()
    if not (MODEL_DIR / "config.json").exists():
        say(f"no model at {MODEL_DIR}; run `.venv/bin/python -m app.cli model pull` first")
        return 2
    prompts = make_prompts(AutoTokenizer.from_pretrained(MODEL_DIR), 32 if quick else 64)
    workdir = Path(tempfile.mkdtemp(prefix="conveyor-pipeline-"))
    meta = {
        "mode": "quick" if quick else "full",
        "cpus": os.cpu_count(),
        "commit": git_commit(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "logs": str(workdir),
    }
    runs, details = [], {}
    for layout in LAYOUTS:
        run, details[layout.name] = measure(layout, prompts, workdir)
        runs.append(run)
    text = markdown(runs, details, meta)
    print(text)
    payload = {"meta": meta, "runs": {r.name: summary(r) for r in runs}, "details": details}
    write_results("pipeline", text, payload)
    return 1 if failed(runs) else 0


if __name__ == "__main__":
    sys.exit(main())
