"""The suite's systems under test, each started as its user starts it and stopped with all it started.

    naive server       bench/naive_server.py under uvicorn: `model.generate` one request at a time
    ray serve          bench/rayserve_app.py: one replica, `@serve.batch` (32, 50 ms) around `generate`
    conveyor 1 stage   `conveyor up` (one whole-model worker, torch's default threads)
    conveyor 2 stages  `conveyor up` with CONVEYOR_STAGES=2, one torch thread per stage worker

A `System` is a base URL and a job client for a given output length; `start(name, ...)` is the context
manager that brings one up. A system that cannot start raises RuntimeError with the reason (the end of
its log when it exited), which the suite reports in place of its figures.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench.load import Job, conveyor_job, load_client, naive_job
from bench.processes import free_port, say, server_process, wait_ready
from bench.prompts import Prompt
from bench.raw import generate_batch, load_model, run_raw
from bench.rayserve_app import batch_sizes, describe
from bench.report import SystemRun
from bench.scheduling_stack import Model, stack, warm_up

NAIVE = "naive server"
RAY = "ray serve"
CONVEYOR_1 = "conveyor 1 stage"
CONVEYOR_2 = "conveyor 2 stages"
SYSTEMS = (NAIVE, RAY, CONVEYOR_1, CONVEYOR_2)
STAGE_SETTINGS = {
    CONVEYOR_1: {},
    # as bench/pipeline.py's 2-stage layout: a thread per stage worker, so the two share the 2 cores
    CONVEYOR_2: {"CONVEYOR_STAGES": "2", "CONVEYOR_TORCH_THREADS": "1"},
}
READY_TIMEOUT_S = 180.0
LOG_TAIL_LINES = 6


@dataclass(frozen=True)
class System:
    name: str
    base_url: str
    make: Callable[..., Job]  # a job client asking for that many tokens (Conveyor's: and a priority)
    streams: bool  # whether its TTFT is a first token (SSE) or the whole answer


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last non-empty lines of a log, for a reason why a system did not come up."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return " | ".join(line.strip()[:200] for line in text if line.strip())[-1200:] if text else ""


def fresh_log(workdir: Path, stem: str) -> Path:
    """`stem.log`, or `stem-2.log` and so on when the system was started before in this run."""
    n = 1
    while (workdir / f"{stem}{'' if n == 1 else f'-{n}'}.log").exists():
        n += 1
    return workdir / f"{stem}{'' if n == 1 else f'-{n}'}.log"


def failed_start(name: str, exc: RuntimeError, log: Path) -> RuntimeError:
    tail = log_tail(log)
    return RuntimeError(f"{name}: {exc}" + (f"; log ends: {tail}" if tail else ""))


@contextmanager
def naive(model: Model, workdir: Path) -> Iterator[System]:
    port = free_port()
    env = dict(os.environ, BENCH_MODEL_PATH=str(model.path))
    argv = [sys.executable, "-m", "uvicorn", "--factory", "bench.naive_server:app_from_env"]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    # Stopped with requests still queued (an unfinished rate): no waiting for them to be served.
    argv += ["--timeout-graceful-shutdown", "1"]
    log = fresh_log(workdir, "naive-server")
    with server_process(NAIVE, argv, env, log, stop_timeout_s=5.0) as process:
        base = f"http://127.0.0.1:{port}"
        try:
            wait_ready(f"{base}/healthz", process, READY_TIMEOUT_S, log)
        except RuntimeError as exc:
            raise failed_start(NAIVE, exc, log) from exc
        yield System(NAIVE, base, naive_job, streams=False)


@contextmanager
def ray_serve(model: Model, workdir: Path) -> Iterator[System]:
    """bench/rayserve_app.py in its own process (Ray's own processes are its children)."""
    try:
        import ray  # noqa: F401  (only whether the `bench` extra is installed)
    except ImportError as exc:
        raise RuntimeError(f"{RAY}: Ray is not installed ({exc}); pip install -e '.[bench]'") from exc
    port = free_port()
    argv = [sys.executable, "-m", "bench.rayserve_app", "--model", str(model.path), "--port", str(port)]
    log = fresh_log(workdir, "ray-serve")
    with server_process(RAY, argv, dict(os.environ), log, stop_timeout_s=30.0) as process:
        base = f"http://127.0.0.1:{port}"
        try:
            wait_ready(f"{base}/healthz", process, READY_TIMEOUT_S, log)
        except RuntimeError as exc:
            raise failed_start(RAY, exc, log) from exc
        try:
            yield System(RAY, base, naive_job, streams=False)
        finally:  # what `@serve.batch` formed, not what it may form (max 32)
            say(f"{RAY}: {describe(batch_sizes(log.read_text(errors='replace')))}")


@contextmanager
def conveyor(name: str, model: Model, workdir: Path, warm: Sequence[Prompt]) -> Iterator[System]:
    """`conveyor up` (bench.scheduling_stack's stack: own namespace, ports and home), warmed up."""
    with stack(name, model, workdir, STAGE_SETTINGS[name]) as s:
        asyncio.run(warm_up(s, list(warm)))
        yield System(name, s.base_url, conveyor_job, streams=True)


def start(name: str, model: Model, workdir: Path, warm: Sequence[Prompt]) -> AbstractContextManager[System]:
    if name == NAIVE:
        return naive(model, workdir)
    if name == RAY:
        return ray_serve(model, workdir)
    return conveyor(name, model, workdir, warm)


async def warm_up_plain(system: System, prompts: Sequence[Prompt]) -> None:
    """One short job, then four at once (first forwards, batch shapes); not counted."""
    job = system.make(8)
    async with load_client(system.base_url, 4) as client:
        first = await job(client, prompts[0])
        if not first.ok:
            say(f"{system.name}: warm-up job failed: {first.error}")
        await asyncio.gather(*(job(client, p) for p in prompts[:4]))


# ---------------------------------------------------------------- raw generate


def raw_limit(
    model: Model,
    prompts: Sequence[Prompt],
    pad_id: int,
    *,
    batches: Sequence[int],
    calls: int,
    max_tokens: int,
) -> list[SystemRun]:
    """In-process `generate` at each batch size: `calls` calls of `batch` prompts, `max_tokens` each."""
    generator = load_model(model.path)
    generate_batch(generator, prompts[:2], pad_id, 8)  # warm-up: first forwards, thread pools
    runs = []
    for batch in batches:
        run = run_raw(generator, prompts[: batch * calls], pad_id, batch, max_tokens)
        say(f"{run.name}: {run.tokens_per_s():.1f} tokens/s over {run.wall_s:.1f} s")
        runs.append(run)
    del generator
    return runs
