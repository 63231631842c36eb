"""The scheduling benchmark's stacks: which model, one `conveyor up` per experiment, and a probe that
samples the stack's queues and step time while load runs.

A stack gets its own namespace, ports and home (as bench.slice's do), a batching mode, and is
stopped, with everything it started, on the way out. The probe reads Redis directly, on the keys
app.core.keys names: the jobs waiting per priority class (the intake streams' lengths: an entry
leaves its stream when dispatched) and stage 0's step-time EWMA as the worker reports it.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from app.core.keys import PRIORITIES, Keys
from bench.load import conveyor_job, load_client
from bench.processes import ROOT, free_port, say, server_process, wait_ready
from bench.prompts import Prompt
from bench.slice import MODEL_DIR, MODEL_NAME, conveyor_env

READY_TIMEOUT_S = 180.0
PROBE_EVERY_S = 0.5


def chosen_model(name: str, workdir: Path) -> Model | None:
    """`tiny` (made in `workdir`) or SmolLM2; None, said, when SmolLM2 has not been pulled yet."""
    model = tiny(workdir) if name == "tiny" else smollm2()
    if not (model.path / "config.json").exists():
        say(f"no model at {model.path}; run `.venv/bin/conveyor model pull` first")
        return None
    return model


@dataclass(frozen=True)
class Model:
    name: str
    path: Path

    def env(self) -> dict[str, str]:
        return {
            "CONVEYOR_MODELS": json.dumps({self.name: str(self.path)}),
            "CONVEYOR_DEFAULT_MODEL": self.name,
        }


def smollm2() -> Model:
    return Model(MODEL_NAME, MODEL_DIR)


def tiny(workdir: Path) -> Model:
    """The tests' tiny random Llama (tests/tiny.py): the stack's machinery without the model's cost."""
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny import make_tiny_model

    return Model("tiny", make_tiny_model(workdir / "tiny-model", context=2048))


@dataclass(frozen=True)
class Stack:
    name: str
    base_url: str
    redis_url: str
    namespace: str
    model: str
    env: dict[str, str]  # CONVEYOR_* and REDIS_URL as the stack saw them


@contextmanager
def stack(name: str, model: Model, workdir: Path, settings: dict[str, str]) -> Iterator[Stack]:
    """`conveyor up` with this run's own namespace, ports and home, plus `settings` (CONVEYOR_*)."""
    port = free_port()
    env = {**conveyor_env(port, workdir), **model.env(), **settings}
    redis_url = env.get("REDIS_URL") or f"redis://127.0.0.1:{env['CONVEYOR_EMBEDDED_REDIS_PORT']}/0"
    log = workdir / f"{name.replace(' ', '-')}.log"
    argv = [sys.executable, "-m", "app.cli", "up"]
    try:
        with server_process(name, argv, env, log, stop_timeout_s=60.0) as process:
            base = f"http://127.0.0.1:{port}"
            started = time.perf_counter()
            wait_ready(f"{base}/readyz", process, READY_TIMEOUT_S, log)
            say(f"{name}: ready after {time.perf_counter() - started:.1f} s")
            used = {k: v for k, v in env.items() if k.startswith("CONVEYOR_") or k == "REDIS_URL"}
            yield Stack(name, base, redis_url, env["CONVEYOR_NAMESPACE"], model.name, used)
    finally:
        shutil.rmtree(workdir / "home", ignore_errors=True)


async def warm_up(stack: Stack, prompts: list[Prompt]) -> None:
    """Two jobs one after the other, then four at once: first forwards and batch shapes, not counted."""
    job = conveyor_job(8)
    async with load_client(stack.base_url, 4) as client:
        for prompt in prompts[:2]:
            result = await job(client, prompt)
            if not result.ok:
                say(f"{stack.name}: warm-up job failed: {result.error}")
        await asyncio.gather(*(job(client, p) for p in prompts[:4]))


async def batch_log(stack: Stack) -> list[tuple[float, dict[str, str]]]:
    """The stack's batch log: (perf_counter time, fields) per entry, oldest first.

    An entry id's milliseconds are Redis's clock (unix time, the same machine): mapped onto this
    process's perf_counter, on which every window of the benchmark is measured.
    """
    client = aioredis.from_url(stack.redis_url, decode_responses=True)
    try:
        entries: Any = await client.xrange(Keys(stack.namespace).batch_log())
    finally:
        await client.aclose()
    offset = time.time() - time.perf_counter()
    return [(int(entry_id.split("-")[0]) / 1000.0 - offset, fields) for entry_id, fields in entries]


# ---------------------------------------------------------------- probe


@dataclass
class Probe:
    """Samples, every `PROBE_EVERY_S`: (perf_counter, jobs waiting per class, stage 0 step EWMA)."""

    stack: Stack
    samples: list[tuple[float, dict[str, int], float | None]] = field(default_factory=list)

    async def run(self) -> None:
        keys = Keys(self.stack.namespace)
        client = aioredis.from_url(self.stack.redis_url)
        try:
            while True:
                pipe = client.pipeline(transaction=False)
                for priority in PRIORITIES:
                    pipe.xlen(keys.intake(priority))
                pipe.hget(keys.latency(self.stack.model), "0")
                *depths, latency = await pipe.execute()
                step = json.loads(latency).get("ewma_s") if latency else None
                self.samples.append((time.perf_counter(), dict(zip(PRIORITIES, depths, strict=True)), step))
                await asyncio.sleep(PROBE_EVERY_S)
        except Exception as exc:  # a probe that cannot read leaves the figures out; the run goes on
            say(f"{self.stack.name}: probe stopped: {type(exc).__name__}: {exc}")
        finally:
            await client.aclose()

    def window(self, start: float, end: float) -> dict[str, Any]:
        """Waiting jobs (all classes; normal) and stage 0's step EWMA over [start, end): median and max."""
        inside = [s for s in self.samples if start <= s[0] < end]
        waiting = [sum(d.values()) for _, d, _ in inside]
        normal = [d.get("normal", 0) for _, d, _ in inside]
        steps = [s for _, _, s in inside if s is not None]
        return {
            "samples": len(inside),
            "waiting_median": statistics.median(waiting) if waiting else None,
            "waiting_max": max(waiting) if waiting else None,
            "normal_waiting_median": statistics.median(normal) if normal else None,
            "normal_waiting_max": max(normal) if normal else None,
            "step_ewma_median_s": statistics.median(steps) if steps else None,
        }
