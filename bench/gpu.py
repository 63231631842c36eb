"""The GPU checks in one command (under 10 minutes): the `gpu` tests, then decode throughput per dtype.

    .venv/bin/python -m bench.gpu [--model DIR] [--quick]

1. `pytest -m gpu tests/gpu` (skipped with `--quick`): every family's tiny model on CUDA against
   `generate`, 1 and 2 stages.
2. Decode throughput of one stage holding the whole model (SmolLM2 where present, else the tests'
   tiny Llama): B prompts prefilled, then 32 decode steps; tokens/s for B in 1, 32, 64 and each
   dtype the GPU has, decode steps eager (`CONVEYOR_COMPILE=off`) and as CUDA graphs (`auto`).
3. A stage's start (load and warm-up, bf16), eager and with its first CUDA graph captured.

Writes bench/results/gpu.md. Without CUDA it says so and exits 2: no figure is ever made up.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.report import git_commit, table, write_results
from bench.systems import ROOT, say

BATCHES = (1, 32, 64)
STEPS = 32
PROMPT_TOKENS = 64


def decode_tokens_per_s(
    path: Path, dtype: torch.dtype, batch: int, device: str, compile_setting: str
) -> float:
    from app.partitions.layers import BatchState, StagePartition, left_pad

    part = StagePartition.load(path, dtype=dtype, device=device)
    part.use_static(compile_setting)
    part.warmup()
    ids, mask = left_pad([[5 + (i % 7)] * PROMPT_TOKENS for i in range(batch)], pad_id=0)
    state = BatchState(part.config, [str(i) for i in range(batch)], mask)
    tokens = part(state, ids).argmax(-1)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(STEPS):
        state.extend(1)
        tokens = part(state, tokens[:, None]).argmax(-1)
    torch.cuda.synchronize()
    return batch * STEPS / (time.perf_counter() - started)


def start_s(path: Path, dtype: torch.dtype, compile_setting: str) -> float:
    """Seconds a stage worker spends making its stage ready, as `app.workers.main.load_partition`
    does it: load, then the warm-up, whose decode step is the first capture where steps are captured."""
    from transformers import AutoConfig

    from app.partitions.layers import LayerRange, StagePartition

    layers = LayerRange(0, int(AutoConfig.from_pretrained(path).num_hidden_layers))
    torch.cuda.synchronize()
    started = time.perf_counter()
    part = StagePartition.load(path, layers, dtype=dtype, device="cuda:0")
    part.use_static(compile_setting)
    part.warmup()
    torch.cuda.synchronize()
    took = time.perf_counter() - started
    del part
    torch.cuda.empty_cache()
    return took


def tiny_model(workdir: Path) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny import make_tiny_model

    return make_tiny_model(workdir / "tiny")  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=ROOT / ".conveyor" / "models" / "SmolLM2-135M-Instruct")
    parser.add_argument("--quick", action="store_true", help="skip the tests; throughput only")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        say("no CUDA device here: nothing measured (run this on a GPU machine)")
        return 2
    name = torch.cuda.get_device_name(0)
    rows = [f"# GPU checks on {torch.cuda.device_count()} x {name}", ""]
    rows.append(f"`python -m bench.gpu` — commit {git_commit()}, {time.strftime('%Y-%m-%d %H:%M:%S')}.")
    rows.append("")
    if not args.quick:
        started = time.perf_counter()
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-m", "gpu", "tests/gpu", "-q", "-p", "no:cacheprovider"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        summary = (result.stdout.strip().splitlines() or ["(no output)"])[-1]
        rows.append(f"- `pytest -m gpu tests/gpu`: {summary} ({time.perf_counter() - started:.0f} s)")
        if result.returncode:
            print(result.stdout[-6000:], result.stderr[-2000:])
    import tempfile

    path = args.model if (args.model / "config.json").exists() else tiny_model(Path(tempfile.mkdtemp()))
    rows += ["", f"Decode throughput, one stage, in process: {path.name}, {PROMPT_TOKENS}-token prompts.", ""]
    dtypes = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_bf16_supported() else [])
    rows += table(
        "dtype | decode steps | " + " | ".join(f"batch {b} tokens/s>" for b in BATCHES),
        (
            [str(dtype).removeprefix("torch."), label]
            + [f"{decode_tokens_per_s(path, dtype, b, 'cuda:0', setting):.0f}" for b in BATCHES]
            for dtype in dtypes
            for setting, label in (("off", "eager"), ("graphs", "CUDA graphs"))
        ),
    )
    starts: dict[str, list[float]] = {"off": [], "auto": []}
    for _ in range(3):  # alternating, so a slow spell hits both
        for setting in starts:
            starts[setting].append(start_s(path, torch.bfloat16, setting))
    eager, graphs = (statistics.median(starts[k]) for k in ("off", "auto"))
    rows += [
        "",
        f"Stage start (load and warm-up, bf16, median of 3): eager {eager:.2f} s, with the first CUDA graph "
        f"captured {graphs:.2f} s ({graphs / eager:.2f}x).",
    ]
    text = "\n".join(rows) + "\n"
    print(text)
    write_results("gpu", text, {"gpu": name, "table": text})
    return 0


if __name__ == "__main__":
    sys.exit(main())
