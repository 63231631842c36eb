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
of a few runs) is the floor Conveyor's c1 TTFT is compared with. One warm-up job per system is not counted.

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
import asyncio
import gc
import json
import os
import platform
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from bench.load import Job, JobResult, conveyor_job, naive_job, run_load
from bench.processes import ROOT, free_port, say, server_process, terminate_on_sigterm, wait_ready
from bench.prompts import SEED, Prompt, make_prompts, spread
from bench.raw import PREFILL_RUNS, load_model, prefill_s, run_raw
from bench.report import (
    SystemRun,
    derived,
    git_commit,
    markdown,
    report_run,
    results_payload,
    token_stats,
    write_results,
)

MODEL_NAME = "SmolLM2-135M-Instruct"
MODEL_DIR = ROOT / ".conveyor" / "models" / MODEL_NAME

MAX_TOKENS = 64
CONCURRENCY = 32
BATCH = 32
READY_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Mode:
    name: str
    concurrent_jobs: int  # raw b32, naive c32, conveyor c32
    sequential_jobs: int  # raw b1, conveyor c1


FULL = Mode("full", concurrent_jobs=64, sequential_jobs=8)
QUICK = Mode("quick", concurrent_jobs=32, sequential_jobs=4)


def measure(
    name: str, base_url: str, job: Job, warmup: Job, prompts: Sequence[Prompt], concurrency: int
) -> SystemRun:
    """One warm-up job, then the prompts under `concurrency` closed-loop clients."""
    warm = asyncio.run(run_load(base_url, warmup, prompts[:1], 1))[0][0]
    if not warm.ok:
        say(f"{name}: warm-up job failed: {warm.error}")
    load = os.getloadavg()[0]
    jobs, wall = asyncio.run(run_load(base_url, job, prompts, concurrency))
    run = SystemRun(name, jobs, wall, load=(load, os.getloadavg()[0]))
    report_run(run)
    return run


def not_run(name: str, prompts: Sequence[Prompt], error: str) -> SystemRun:
    say(f"{name}: not measured: {error}")
    return SystemRun(name, [JobResult(p.index, False, 0.0, None, 0, error) for p in prompts], 0.0, note=error)


# ---------------------------------------------------------------- systems


def bench_raw(
    tokenizer: Any, all_prompts: list[Prompt], few: list[Prompt]
) -> tuple[list[SystemRun], dict[str, Any]]:
    model = load_model(MODEL_DIR)
    pad_id = int(tokenizer.pad_token_id)
    runs = []
    for prompts, batch in ((few, 1), (all_prompts, BATCH)):
        run = run_raw(model, prompts, pad_id, batch, MAX_TOKENS)
        report_run(run)
        runs.append(run)
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


def bench_naive(prompts: list[Prompt], workdir: Path) -> SystemRun:
    port = free_port()
    env = dict(os.environ, BENCH_MODEL_PATH=str(MODEL_DIR))
    argv = [sys.executable, "-m", "uvicorn", "--factory", "bench.naive_server:app_from_env"]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    log = workdir / "naive-server.log"
    name = f"naive server c{CONCURRENCY}"
    try:
        with server_process("naive server", argv, env, log, stop_timeout_s=15.0) as process:
            base = f"http://127.0.0.1:{port}"
            wait_ready(f"{base}/healthz", process, READY_TIMEOUT_S, log)
            return measure(name, base, naive_job(MAX_TOKENS), naive_job(8), prompts, CONCURRENCY)
    except RuntimeError as exc:
        return not_run(name, prompts, f"naive server: {exc}")


def conveyor_env(api_port: int, workdir: Path) -> dict[str, str]:
    """The user's environment (REDIS_URL and any CONVEYOR_* pass through) plus this run's own stack."""
    env = dict(os.environ)
    env.update(
        CONVEYOR_FLOWER="false",
        CONVEYOR_API_PORT=str(api_port),
        CONVEYOR_NAMESPACE=f"bench-{secrets.token_hex(4)}",
        CONVEYOR_EMBEDDED_REDIS_PORT=str(free_port()),
        # Its own home: the embedded Redis keeps its data away from a developer's .conveyor/redis.
        CONVEYOR_HOME=str(workdir / "home"),
        CONVEYOR_MODELS=json.dumps({MODEL_NAME: str(MODEL_DIR)}),
        CONVEYOR_EMBEDDING_STAGES="0",  # only the generation pipeline is measured
    )
    env.setdefault("CONVEYOR_AUTH", "none")  # the load clients send no credential (loopback only)
    return env


def bench_conveyor(
    all_prompts: list[Prompt], few: list[Prompt], workdir: Path
) -> tuple[list[SystemRun], dict[str, str]]:
    port = free_port()
    env = conveyor_env(port, workdir)
    used = {k: v for k, v in env.items() if k.startswith("CONVEYOR_") or k == "REDIS_URL"}
    log = workdir / "conveyor-up.log"
    names = ("conveyor c1", f"conveyor c{CONCURRENCY}")
    try:
        with server_process(
            "conveyor up", [sys.executable, "-m", "app.cli", "up"], env, log, stop_timeout_s=60.0
        ) as process:
            base = f"http://127.0.0.1:{port}"
            started = time.perf_counter()
            wait_ready(f"{base}/readyz", process, READY_TIMEOUT_S, log)
            say(f"conveyor: ready after {time.perf_counter() - started:.1f} s")
            job, warmup = conveyor_job(MAX_TOKENS), conveyor_job(8)
            runs = [measure(names[0], base, job, warmup, few, 1)]
            runs.append(measure(names[1], base, job, warmup, all_prompts, CONCURRENCY))
            return runs, used
    except RuntimeError as exc:
        error = f"conveyor: {exc}"
        return [not_run(names[0], few, error), not_run(names[1], all_prompts, error)], used
    finally:
        shutil.rmtree(workdir / "home", ignore_errors=True)


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
    raw_runs, prefill = bench_raw(tokenizer, prompts, few)
    naive = bench_naive(prompts, workdir)
    conveyor_runs, meta["conveyor_env"] = bench_conveyor(prompts, few, workdir)
    runs = [*raw_runs, naive, *conveyor_runs]
    meta["bench_wall_s"] = time.perf_counter() - started
    eos = tokenizer.eos_token_id
    eos_ids = {eos} if isinstance(eos, int) else set(eos or [])
    extra = derived({r.name: r for r in runs}, prefill, eos_ids, concurrency=CONCURRENCY, batch=BATCH)
    text = markdown(runs, extra, meta, prefill_runs=PREFILL_RUNS)
    print(text)
    write_results("slice", text, results_payload(runs, extra, meta))
    return 0 if all(not r.summary()["failed"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
