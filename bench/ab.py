"""A/B: this tree's Conveyor against an earlier commit's, in one run, on the same machine and prompts.

Did a change cost speed or change answers? Both trees run `python -m app.cli up` from temporary git
worktrees (the earlier commit, and a snapshot of this checkout's working tree, uncommitted files
included), with this checkout's virtualenv and model, under the same load
(SmolLM2-135M-Instruct, seeded chat prompts, 64 tokens each with `ignore_eos`):

    speed     at its defaults: one job at a time over a spread of the prompts (c1: TTFT p50), then
              every prompt under 32 closed-loop clients (c32: peak tokens/s); the trees alternate,
              A B B A, over `--rounds` pairs; each figure is the median of its tree's rounds.
    answers   in fp32, one job at a time: the greedy tokens of every sequential prompt, compared up
              to the first EOS.

About 2 minutes per stack start and load on 2 cores; `--quick` halves the jobs:

    .venv/bin/python -m bench.ab [--base 6399fb6] [--rounds 2] [--quick]

Prints a Markdown table with the ratios (this tree / base) and writes bench/results/ab.md and .json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from bench.load import Run, closed_run
from bench.prompts import Prompt, make_prompts, spread
from bench.report import git_commit, greedy_agreement, percentile, report_run, table, write_results
from bench.systems import MODEL_DIR, ROOT, conveyor, say, terminate_on_sigterm, warm_up

DEFAULT_BASE = "6399fb6"  # the commit before the job record and the stage worker were rebuilt
MAX_TOKENS = 64
CONCURRENCY = 32
JOBS = {False: (64, 8), True: (32, 4)}  # --quick: (all the prompts, the sequential ones)


def ab_prompts(quick: bool) -> tuple[Any, list[Prompt], list[Prompt]] | None:
    """The model's tokenizer, the run's prompts and the sequential ones among them; None (said why)
    when the model has not been pulled."""
    if not (MODEL_DIR / "config.json").exists():
        say(f"no model at {MODEL_DIR}; run `.venv/bin/python -m app.cli model pull` first")
        return None
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    jobs, sequential = JOBS[quick]
    prompts = make_prompts(tokenizer, jobs)
    return tokenizer, prompts, spread(prompts, sequential)


def snapshot() -> str:
    """A commit of this checkout's working tree as it is (uncommitted and untracked files included,
    ignored ones not), made through a temporary index: the real index and HEAD are left alone."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "GIT_INDEX_FILE": str(Path(tmp) / "index")}

        def git(*args: str) -> str:
            run = subprocess.run(
                ["git", *args], cwd=ROOT, env=env, capture_output=True, text=True, check=True
            )
            return run.stdout.strip()

        git("read-tree", "HEAD")
        git("add", "-A")
        return git("commit-tree", git("write-tree"), "-p", "HEAD", "-m", "bench.ab: the working tree")


@contextmanager
def worktree(rev: str) -> Iterator[Path]:
    """`rev` checked out in a temporary directory (removed afterwards)."""
    path = Path(tempfile.mkdtemp(prefix="conveyor-ab-")) / "tree"
    subprocess.run(["git", "worktree", "add", "--detach", "-q", str(path), rev], cwd=ROOT, check=True)
    try:
        yield path
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=ROOT, check=False)
        shutil.rmtree(path.parent, ignore_errors=True)


def run_tree(
    label: str, tree: Path, prompts: list[Prompt], few: list[Prompt], workdir: Path, **settings: str
) -> list[Run]:
    """One stack of `tree`: c1 over `few`, then c32 over `prompts` unless `prompts` is empty."""
    loads = [(f"{label} c1", few, 1)] + (
        [(f"{label} c{CONCURRENCY}", prompts, CONCURRENCY)] if prompts else []
    )
    with conveyor(f"{label} up", workdir, settings, cwd=tree) as system:
        warm_up(system, few)
        runs = [closed_run(name, system.base_url, system.make(MAX_TOKENS), p, c) for name, p, c in loads]
    for run in runs:
        report_run(run)
    return runs


def ttft_p50(run: Run) -> float | None:
    return percentile([j.ttft_s for j in run.ok if j.ttft_s is not None], 50)


def tree_cells(tree: str, f: dict[str, Any]) -> list[str]:
    """A tree's row: its medians, then each round's figures."""
    rounds = ", ".join(f"{r['peak_tokens_per_s']:.1f} / {r['c1_ttft_p50_s'] * 1000:.0f}" for r in f["rounds"])
    return [tree, f"{f['peak_tokens_per_s']:.1f}", f"{f['c1_ttft_p50_s'] * 1000:.0f} ms", rounds]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default=DEFAULT_BASE, help=f"the earlier commit (default {DEFAULT_BASE})")
    parser.add_argument("--rounds", type=int, default=2, help="A B pairs of the speed runs (default 2)")
    parser.add_argument("--quick", action="store_true", help="fewer jobs per run")
    args = parser.parse_args(argv)
    terminate_on_sigterm()
    loaded = ab_prompts(args.quick)
    if loaded is None:
        return 2
    tokenizer, prompts, few = loaded
    workdir = Path(tempfile.mkdtemp(prefix="conveyor-ab-logs-"))
    head = git_commit()
    base_rev = subprocess.run(
        ["git", "rev-parse", "--short", args.base], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    say(f"A/B: base {base_rev} against this tree {head}; {len(prompts)} prompts, logs in {workdir}")
    started = time.perf_counter()
    speed: dict[str, list[tuple[float, float | None]]] = {"base": [], "head": []}
    answers: dict[str, Run] = {}
    loads = [os.getloadavg()[0]]
    # Both trees run from worktrees: the head's is a snapshot of this checkout. Run from the checkout
    # itself, the head answered its first token ~10 ms later than a worktree of the same commit
    # (1.17x c1 TTFT; bench/results/ab-11eafd2-self-quick.md).
    with worktree(args.base) as base_tree, worktree(snapshot()) as head_tree:
        trees = {"base": base_tree, "head": head_tree}
        for round_ in range(args.rounds):
            for label in ("base", "head") if round_ % 2 == 0 else ("head", "base"):
                c1, peak = run_tree(label, trees[label], prompts, few, workdir)
                speed[label].append((peak.tokens_per_s(), ttft_p50(c1)))
                loads.append(os.getloadavg()[0])
        for label in ("base", "head"):
            (answers[label],) = run_tree(label, trees[label], [], few, workdir, CONVEYOR_DTYPE="float32")
    eos = tokenizer.eos_token_id
    agreement = greedy_agreement(answers["base"], answers["head"], {eos} if isinstance(eos, int) else set())
    figures: dict[str, dict[str, Any]] = {
        label: {
            "peak_tokens_per_s": statistics.median(t for t, _ in runs),
            "c1_ttft_p50_s": statistics.median(x for _, x in runs if x is not None),
            "rounds": [{"peak_tokens_per_s": t, "c1_ttft_p50_s": x} for t, x in runs],
        }
        for label, runs in speed.items()
    }
    tokens = figures["head"]["peak_tokens_per_s"] / figures["base"]["peak_tokens_per_s"]
    ttft = figures["head"]["c1_ttft_p50_s"] / figures["base"]["c1_ttft_p50_s"]
    revs = (("base", base_rev), ("head", head))
    command = " ".join(["python -m bench.ab", *(sys.argv[1:] if argv is None else argv)])
    lines = [
        f"# A/B: {head} against {base_rev}",
        "",
        f"`{command}` ({time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, load "
        f"{min(loads):.1f}-{max(loads):.1f}; {args.rounds} rounds each, alternating; medians)",
        "",
        *table(
            f"tree | peak tokens/s (c{CONCURRENCY})> | c1 TTFT p50> | rounds (tokens/s, TTFT ms)",
            [tree_cells(f"{label} {rev}", figures[label]) for label, rev in revs],
        ),
        "",
        f"- this tree / base: peak tokens/s **{tokens:.2f}x**, c1 TTFT p50 **{ttft:.2f}x** (lower is faster)",
        f"- greedy tokens in fp32, one job at a time: {agreement['identical']} of {agreement['compared']} "
        "prompts identical",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    payload = {
        "meta": {
            "base": base_rev,
            "head": head,
            "command": command,
            "rounds": args.rounds,
            "mode": "quick" if args.quick else "full",
            "loads": loads,
            "bench_wall_s": time.perf_counter() - started,
        },
        "figures": figures,
        "ratios": {"peak_tokens_per_s": tokens, "c1_ttft_p50": ttft},
        "greedy_fp32": agreement,
    }
    write_results("ab", text, payload)
    return 0 if agreement["identical"] == agreement["compared"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
