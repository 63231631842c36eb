"""The slice benchmark: Conveyor against in-process generation and a naive server, in one run, same prompts.

What is measured (SmolLM2-135M-Instruct, fp32, CPU, greedy, torch's default threads). Every job generates
exactly 64 tokens: `max_new_tokens = min_new_tokens = 64` for raw generate, `max_tokens: 64,
ignore_eos: true` for the servers.

    raw generate b1    in-process `model.generate`, one prompt at a time
    raw generate b32   in-process `model.generate`, 32 prompts per call (left padding, attention mask)
    naive server c32   bench/naive_server.py (one request at a time behind a lock), 32 concurrent clients
    conveyor c1        `python -m app.cli up` as a subprocess, one job after another (POST /v1/jobs + SSE)
    conveyor c32       the same stack, 32 concurrent clients

Per job: end-to-end latency and time to first token (TTFT) on the client's clock; the naive server does
not stream, so its TTFT is its latency. For raw generate a job's latency is its `generate` call and its
TTFT the moment that call produced its first token. Per system: throughput in generated tokens/s over
the whole run (tokens of successful jobs / wall time from the first submit to the last completion),
P50/P99 latency and P50 TTFT. The raw prefill time (one forward pass over one prompt at batch 1, median
of a few runs) is the floor Conveyor's c1 TTFT is compared with. A server's warm-up jobs (bench.systems'
`warm_up`) are not counted.

The prompts are a seeded list of chat requests whose user messages span roughly 10 to 120 tokens (the
chat template adds its system prompt); every system gets the same token ids. The concurrent systems run
the whole list (64 jobs, 2 rounds of 32; 32 with --quick), the sequential ones a subset spread over the
prompt lengths (8; 4 with --quick).

Run from the repository root (about 6-8 minutes on 2 cores; --quick about half of that):

    .venv/bin/python -m bench.slice [--quick]

Prints a Markdown table and the target ratios; writes bench/results/slice.md and bench/results/slice.json.
The Conveyor stack gets its own namespace, ports and home directory (embedded Redis data, unless
REDIS_URL is set); the logs of both servers are kept in a temporary directory whose path is printed.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from bench.load import JobResult, Run, closed_run
from bench.prompts import SEED, Prompt, make_prompts, spread
from bench.raw import PREFILL_RUNS, prefill_s, raw_runs
from bench.report import (
    Target,
    failed,
    failure_lines,
    fmt,
    git_commit,
    greedy_agreement,
    percentile,
    ratio,
    report_run,
    system_table,
    systems_record,
    target_rows,
    token_stats,
    write_results,
)
from bench.systems import MODEL_DIR, MODEL_NAME, System, conveyor, naive, say, terminate_on_sigterm, warm_up

MAX_TOKENS = 64
CONCURRENCY = 32
BATCH = 32
TARGETS = [
    Target("conveyor_vs_naive", "conveyor c32 / naive c32 throughput", 3.8, True),
    Target("conveyor_vs_raw_b32", "conveyor c32 / raw b32 throughput", 0.7, True),
    Target(
        "ttft_overhead_ms", "conveyor c1 p50 TTFT - raw prefill", 30, False, unit=" ms", scale=1000, digits=1
    ),
]


@dataclass(frozen=True)
class Mode:
    name: str
    concurrent_jobs: int  # raw b32, naive c32, conveyor c32
    sequential_jobs: int  # raw b1, conveyor c1


FULL = Mode("full", concurrent_jobs=64, sequential_jobs=8)
QUICK = Mode("quick", concurrent_jobs=32, sequential_jobs=4)


def measure(system: System, loads: Sequence[tuple[str, Sequence[Prompt], int]]) -> list[Run]:
    """The system warmed up, then each (name, prompts, concurrency) as a closed loop, `MAX_TOKENS` a job."""
    warm_up(system, loads[0][1])
    runs = []
    for name, prompts, clients in loads:
        runs.append(closed_run(name, system.base_url, system.make(MAX_TOKENS), prompts, clients))
        report_run(runs[-1])
    return runs


def not_run(name: str, prompts: Sequence[Prompt], error: str) -> Run:
    say(f"{name}: not measured: {error}")
    return Run(name, [JobResult(p.index, False, 0.0, None, 0, error) for p in prompts], note=error)


def bench_raw(
    tokenizer: Any, all_prompts: list[Prompt], few: list[Prompt]
) -> tuple[list[Run], dict[str, Any]]:
    plan = [(few, 1), (all_prompts, BATCH)]
    model, runs = raw_runs(MODEL_DIR, plan, int(tokenizer.pad_token_id), MAX_TOKENS)
    median_prompt = sorted(few, key=lambda p: len(p.ids))[len(few) // 2]
    prefill = {
        "prompt": median_prompt.index,
        "prompt_tokens": len(median_prompt.ids),
        "seconds": prefill_s(model, median_prompt, PREFILL_RUNS),
    }
    say(
        f"raw prefill of prompt {median_prompt.index} ({len(median_prompt.ids)} tokens): "
        f"{prefill['seconds'] * 1000:.1f} ms"
    )
    del model
    gc.collect()
    return runs, prefill


def bench_servers(
    all_prompts: list[Prompt], few: list[Prompt], workdir: Path
) -> tuple[list[Run], dict[str, str]]:
    """The naive server at c32, then Conveyor at c1 and c32; a system that did not start is a run
    of failed jobs."""
    runs: list[Run] = []
    naive_name, names = f"naive server c{CONCURRENCY}", ("conveyor c1", f"conveyor c{CONCURRENCY}")
    try:
        with naive(workdir) as system:
            runs += measure(system, [(naive_name, all_prompts, CONCURRENCY)])
    except RuntimeError as exc:
        runs.append(not_run(naive_name, all_prompts, str(exc)))
    try:
        with conveyor("conveyor up", workdir) as system:
            runs += measure(system, [(names[0], few, 1), (names[1], all_prompts, CONCURRENCY)])
            return runs, dict(system.env)
    except RuntimeError as exc:
        return [*runs, not_run(names[0], few, str(exc)), not_run(names[1], all_prompts, str(exc))], {}


# ---------------------------------------------------------------- figures and report


def derived(
    runs: Mapping[str, Run], prefill: dict[str, Any], eos_ids: set[int], *, concurrency: int, batch: int
) -> dict[str, Any]:
    """The slice's figures: throughput ratios, TTFT against the raw prefill, Conveyor's batch sizes."""
    c1, c32 = runs["conveyor c1"], runs[f"conveyor c{concurrency}"]
    naive_run, raw32 = runs[f"naive server c{concurrency}"], runs[f"raw generate b{batch}"]
    c1_ttft = percentile([j.ttft_s for j in c1.ok if j.ttft_s is not None], 50)
    server_ttft = percentile([j.server_ttft_s for j in c1.ok if j.server_ttft_s is not None], 50)
    batches = {j.batch_id: j.batch_size for j in c32.ok if j.batch_id and j.batch_size}
    sizes = sorted(batches.values())
    job_sizes = [j.batch_size for j in c32.ok if j.batch_size]
    overhead = c1_ttft - prefill["seconds"] if c1_ttft is not None else None
    return {
        "conveyor_vs_naive": ratio(c32.tokens_per_s(), naive_run.tokens_per_s()),
        "conveyor_vs_raw_b32": ratio(c32.tokens_per_s(), raw32.tokens_per_s()),
        "raw_prefill": prefill,
        "conveyor_c1_p50_ttft_s": c1_ttft,
        "ttft_overhead_s": overhead,
        "conveyor_c1_p50_server_ttft_s": server_ttft,
        "conveyor_c32_p50_server_ttft_s": percentile(
            [j.server_ttft_s for j in c32.ok if j.server_ttft_s is not None], 50
        ),
        "conveyor_c32_mean_batch_size": sum(sizes) / len(sizes) if sizes else None,
        "conveyor_c32_job_weighted_batch_size": sum(job_sizes) / len(job_sizes) if job_sizes else None,
        "conveyor_c32_batch_sizes": sizes,
        "greedy_agreement_c1_vs_raw_b1": greedy_agreement(runs["raw generate b1"], c1, eos_ids),
    }


def notes(runs: Sequence[Run], extra: dict[str, Any], meta: dict[str, Any]) -> list[str]:
    prefill, agreement = extra["raw_prefill"], extra["greedy_agreement_c1_vs_raw_b1"]
    return [
        f"- raw prefill, batch 1, prompt of {prefill['prompt_tokens']} tokens (median of {PREFILL_RUNS}): "
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


def markdown(runs: Sequence[Run], extra: dict[str, Any], meta: dict[str, Any]) -> str:
    """The slice report: the system table, the targets, the notes behind them, any failures."""
    values = {  # the overhead's target is in ms: its value in seconds, shown times 1000
        "conveyor_vs_naive": extra["conveyor_vs_naive"],
        "conveyor_vs_raw_b32": extra["conveyor_vs_raw_b32"],
        "ttft_overhead_ms": extra["ttft_overhead_s"],
    }
    lines = [
        f"# Conveyor slice benchmark ({meta['mode']})",
        "",
        f"{meta['model']}, fp32, CPU ({meta['cpus']} cores, torch threads {meta['torch_threads']}), greedy, "
        f"{meta['max_tokens']} tokens per job; {meta['started']}, commit {meta['commit']}.",
        "",
        *system_table(runs),
        "",
        *target_rows(TARGETS, values),
        "",
        *notes(runs, extra, meta),
        *failure_lines(runs),
    ]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- main


def run_meta(mode: Mode, prompts: list[Prompt], few: list[Prompt], workdir: Path) -> dict[str, Any]:
    """What the result files record about this run, before any system ran."""
    return {
        "mode": mode.name,
        "model": MODEL_NAME,
        "max_tokens": MAX_TOKENS,
        "concurrency": CONCURRENCY,
        "seed": SEED,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "commit": git_commit(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "logs": str(workdir),
        "prompt_tokens": token_stats([len(p.ids) for p in prompts]),
        "user_tokens": token_stats([p.user_tokens for p in prompts]),
        "sequential_prompts": [p.index for p in few],
    }


def slice_prompts(mode: Mode) -> tuple[Any, list[Prompt], list[Prompt]] | None:
    """The model's tokenizer, the run's prompts and the sequential ones among them; None (said why)
    when the model has not been pulled."""
    if not (MODEL_DIR / "config.json").exists():
        say(f"no model at {MODEL_DIR}; run `.venv/bin/python -m app.cli model pull` first")
        return None
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    prompts = make_prompts(tokenizer, mode.concurrent_jobs)
    return tokenizer, prompts, spread(prompts, mode.sequential_jobs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer jobs per system (a smoke run)")
    mode = QUICK if parser.parse_args(argv).quick else FULL
    terminate_on_sigterm()
    loaded = slice_prompts(mode)
    if loaded is None:
        return 2
    tokenizer, prompts, few = loaded
    workdir = Path(tempfile.mkdtemp(prefix="conveyor-bench-"))
    meta = run_meta(mode, prompts, few, workdir)
    say(
        f"{mode.name} run: {len(prompts)} prompts ({meta['prompt_tokens']} tokens), "
        f"{len(few)} sequential; logs in {workdir}"
    )
    started = time.perf_counter()
    raw, prefill = bench_raw(tokenizer, prompts, few)
    servers, meta["conveyor_env"] = bench_servers(prompts, few, workdir)
    runs = [*raw, *servers]
    meta["bench_wall_s"] = time.perf_counter() - started
    eos = tokenizer.eos_token_id
    eos_ids = {eos} if isinstance(eos, int) else set(eos or [])
    extra = derived({r.name: r for r in runs}, prefill, eos_ids, concurrency=CONCURRENCY, batch=BATCH)
    text = markdown(runs, extra, meta)
    print(text)
    payload = {
        "meta": meta,
        "targets": {t.key: t.goal for t in TARGETS},
        "derived": extra,
        "systems": systems_record(runs),
    }
    write_results("slice", text, payload)
    return 1 if failed(runs) else 0


if __name__ == "__main__":
    sys.exit(main())
