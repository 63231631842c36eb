"""In-process generation, the reference the servers are measured against.

`run_raw` calls `model.generate` on batches of prompts (left padding, attention mask, greedy, exactly
`max_tokens` new tokens): a job's latency is its `generate` call and its TTFT the moment that call
produced its first token; `raw_runs` loads the model once for several such runs. Loaded in process rather
than started (bench/systems.py starts the servers), with torch imported here only.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM
from transformers.generation.streamers import BaseStreamer

from bench.load import JobResult, Run, checked, loadavg
from bench.naive_server import generate_rows
from bench.prompts import Prompt
from bench.systems import say


class FirstTokenClock(BaseStreamer):
    """Notes when `generate` hands out its first new token (its first `put` is the prompt)."""

    def __init__(self) -> None:
        self.puts = 0
        self.first_token_at: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


def load_model(path: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def generate_batch(model: Any, prompts: Sequence[Prompt], pad_id: int, max_tokens: int) -> list[JobResult]:
    """One `generate` call over `prompts`; every job's latency is the call, its TTFT the first token."""
    clock = FirstTokenClock()
    started = time.perf_counter()
    try:
        new = generate_rows(model, [p.ids for p in prompts], pad_id, max_tokens, exact=True, streamer=clock)
    except Exception as exc:  # a failed call fails its jobs; the run goes on
        elapsed = time.perf_counter() - started
        return [JobResult(p.index, False, elapsed, None, 0, f"{type(exc).__name__}: {exc}") for p in prompts]
    elapsed = time.perf_counter() - started
    ttft = clock.first_token_at - started if clock.first_token_at is not None else None
    return [
        checked(
            JobResult(p.index, True, elapsed, ttft, int(new.shape[1]), token_ids=new[i].tolist()), max_tokens
        )
        for i, p in enumerate(prompts)
    ]


def run_raw(model: Any, prompts: Sequence[Prompt], pad_id: int, batch: int, max_tokens: int) -> Run:
    """The prompts in batches of `batch`, one `generate` call after another, after a short warm-up call."""
    generate_batch(model, prompts[:1], pad_id, 8)  # warm-up
    jobs: list[JobResult] = []
    load = loadavg()
    started = time.perf_counter()
    for first in range(0, len(prompts), batch):
        jobs += generate_batch(model, prompts[first : first + batch], pad_id, max_tokens)
    wall = time.perf_counter() - started
    return Run(f"raw generate b{batch}", jobs, wall, (load, loadavg()), clients=batch)


def raw_runs(
    path: Path, plan: Sequence[tuple[Sequence[Prompt], int]], pad_id: int, max_tokens: int
) -> tuple[Any, list[Run]]:
    """The model at `path` loaded once, then `run_raw` for each (prompts, batch) of the plan, said as it
    goes; the model comes back with the runs (drop it to free its memory)."""
    model = load_model(path)
    runs = []
    for prompts, batch in plan:
        run = run_raw(model, prompts, pad_id, batch, max_tokens)
        ok, rate = f"{len(run.ok)}/{len(run.jobs)}", run.tokens_per_s()
        say(f"{run.name}: {ok} jobs, {rate:.1f} tokens/s over {run.wall_s:.1f} s")
        runs.append(run)
    return model, runs
