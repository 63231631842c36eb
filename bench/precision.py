"""bf16 against fp32 through the whole stack, in one run: what `CONVEYOR_DTYPE=auto` should pick here.

Two `conveyor up` stacks, one after the other, on the same seeded prompts (SmolLM2-135M-Instruct,
one stage, closed-loop clients, every job exactly 64 new tokens): `CONVEYOR_DTYPE=float32`, then
`bfloat16`. At 32 and 64 clients the stage runs decode steps of that many rows nearly all the time,
so tokens/s is the decode rate a user gets. It prints both, the ratio bf16 / fp32, this CPU's native
bf16 instruction sets, and what `auto` picks on it (and why).

    .venv/bin/python -m bench.precision [--quick]

Writes bench/results/precision.md and bench/results/precision.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from transformers import AutoTokenizer

from app.partitions.precision import cpu_bf16_flags, dtype_name, resolve_dtype
from bench.load import Run, closed_run
from bench.prompts import Prompt, make_prompts
from bench.report import failed, git_commit, report_run, summary, write_results
from bench.systems import MODEL_DIR, MODEL_NAME, conveyor, say, terminate_on_sigterm, warm_up

MAX_TOKENS = 64
CONCURRENCY = (32, 64)
DTYPES = ("float32", "bfloat16")


def measure(dtype: str, prompts: list[Prompt], workdir: Path) -> list[Run]:
    runs = []
    with conveyor(dtype, workdir, {"CONVEYOR_DTYPE": dtype}) as system:
        warm_up(system, prompts)
        for clients in CONCURRENCY:
            job = system.make(MAX_TOKENS)
            runs.append(
                closed_run(f"{dtype} c{clients}", system.base_url, job, prompts[: 2 * clients], clients)
            )
            report_run(runs[-1])
    return runs


def markdown(runs: dict[str, Run], meta: dict[str, object]) -> str:
    lines = [
        f"# bf16 against fp32 through the stack ({meta['mode']})",
        "",
        f"`{meta['command']}` — {MODEL_NAME}, 1 stage, CPU ({meta['cpus']} cores, native bf16: "
        f"{meta['bf16_flags'] or 'none'}), closed-loop clients, {MAX_TOKENS} tokens per job; "
        f"{meta['started']}, commit {meta['commit']}.",
        "",
        "| clients | fp32 tokens/s | bf16 tokens/s | bf16 / fp32 | fp32 ok | bf16 ok |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    ratios = []
    for clients in CONCURRENCY:
        fp32, bf16 = runs[f"float32 c{clients}"], runs[f"bfloat16 c{clients}"]
        ratio = bf16.tokens_per_s() / fp32.tokens_per_s() if fp32.tokens_per_s() else 0.0
        ratios.append(ratio)
        lines.append(
            f"| {clients} | {fp32.tokens_per_s():.1f} | {bf16.tokens_per_s():.1f} | {ratio:.2f}x | "
            f"{len(fp32.ok)}/{len(fp32.jobs)} | {len(bf16.ok)}/{len(bf16.jobs)} |"
        )
    faster = all(r > 1.0 for r in ratios)
    lines += [
        "",
        f"- `CONVEYOR_DTYPE=auto` picks **{meta['auto']}** on this CPU: "
        + (
            "it has native bf16."
            if meta["auto"] == "bfloat16"
            else "it has no native bf16, so bf16 would be emulated: fp32 is both exact and quicker."
        ),
        f"- Through the stack bf16 was {'faster' if faster else 'not faster'} at every batch size measured.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one pass of each client count, fewer prompts")
    quick = parser.parse_args(argv).quick
    terminate_on_sigterm()
    if not (MODEL_DIR / "config.json").exists():
        say(f"no model at {MODEL_DIR}; run `.venv/bin/python -m app.cli model pull` first")
        return 2
    prompts = make_prompts(AutoTokenizer.from_pretrained(MODEL_DIR), 2 * max(CONCURRENCY))
    workdir = Path(tempfile.mkdtemp(prefix="conveyor-precision-"))
    meta: dict[str, object] = {
        "mode": "quick" if quick else "full",
        "command": "python -m bench.precision" + (" --quick" if quick else ""),
        "cpus": os.cpu_count(),
        "commit": git_commit(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "bf16_flags": ", ".join(sorted(cpu_bf16_flags())),
        "auto": dtype_name(resolve_dtype("auto", "cpu")),
    }
    runs: dict[str, Run] = {}
    for dtype in DTYPES:
        for run in measure(dtype, prompts[: max(CONCURRENCY) if quick else None], workdir):
            runs[run.name] = run
    text = markdown(runs, meta)
    print(text)
    write_results("precision", text, {"meta": meta, "runs": {k: summary(r) for k, r in runs.items()}})
    return 1 if failed(list(runs.values())) else 0


if __name__ == "__main__":
    sys.exit(main())
