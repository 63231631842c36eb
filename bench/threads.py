"""Which thread runs the model: why a stage worker has one compute thread.

A stage worker receives messages on several threads (Celery's task threads, its lane thread). Torch
runs its CPU kernels on an OpenMP team that belongs to the calling thread. This benchmark runs the
same decode steps of a batch of 32 sequences (SmolLM2-135M-Instruct, fp32, torch's default threads)
in four layouts, each in a fresh process since the effect depends on the process's history:

    main thread        weights loaded and steps run on the main thread
    loaded elsewhere   weights loaded (and warmed up) on the main thread, steps run on another
                       thread
    spread             as loaded elsewhere, and two more threads (Celery's task threads) have each
                       run a prefill: the stage worker before its compute thread
    compute thread     weights loaded, warmed up and run on one thread that is not the main
                       thread, which never runs a kernel: the stage worker now

Each layout: one prefill of 32 prompts, then decode steps for `--seconds`; the median step time.
The layouts take turns for `--rounds` rounds (a slow spell of the shared machine hits all of them);
a layout's figure is the median over its rounds. Ratios are against the main thread, in one run.

    .venv/bin/python -m bench.threads [--seconds 8] [--rounds 3]     (about 3 minutes)

Writes bench/results/threads.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

from bench.systems import ROOT, say

LAYOUTS = ("main thread", "loaded elsewhere", "spread", "compute thread")
BATCH = 32
RESULTS = ROOT / "bench" / "results" / "threads.md"


def decode_steps(seconds: float) -> dict[str, Any]:
    """In a child: the layout's decode steps; returns their median and count."""
    import torch
    from transformers import AutoTokenizer

    from app.partitions.layers import BatchState, StagePartition, left_pad
    from bench.prompts import make_prompts
    from bench.systems import smollm2

    model = smollm2()
    tokenizer = AutoTokenizer.from_pretrained(model.path)
    prompts = make_prompts(tokenizer, BATCH)

    def load() -> StagePartition:
        partition = StagePartition.load(model.path)
        partition.warmup()
        return partition

    def run(partition: StagePartition) -> list[float]:
        ids, mask = left_pad([p.ids for p in prompts], int(tokenizer.pad_token_id))
        state = BatchState(partition.config, [str(p.index) for p in prompts], mask)
        tokens = partition(state, ids).argmax(-1)
        steps: list[float] = []
        until = time.perf_counter() + seconds
        while time.perf_counter() < until:
            started = time.perf_counter()
            state.extend(1)
            tokens = partition(state, tokens[:, None]).argmax(-1)
            steps.append(time.perf_counter() - started)
        return steps

    def on_thread(fn: Any, *args: Any) -> Any:
        out: list[Any] = []
        worker = threading.Thread(target=lambda: out.append(fn(*args)))
        worker.start()
        worker.join()
        return out[0]

    def prefill_on_threads(partition: StagePartition, count: int) -> None:
        """Start threads that each run one prefill, then stay alive (their OpenMP teams with them)."""
        ids, mask = left_pad([p.ids for p in prompts[:4]], int(tokenizer.pad_token_id))
        never, ran = threading.Event(), threading.Semaphore(0)

        def task() -> None:
            partition(BatchState(partition.config, ["a", "b", "c", "d"], mask.clone()), ids)
            ran.release()
            never.wait()

        for _ in range(count):
            threading.Thread(target=task, daemon=True).start()
            ran.acquire()

    layout = sys.argv[2]
    if layout == "main thread":
        steps = run(load())
    elif layout == "loaded elsewhere":
        steps = on_thread(run, load())
    elif layout == "spread":
        partition = load()
        prefill_on_threads(partition, 2)
        steps = on_thread(run, partition)
    else:
        steps = on_thread(lambda: run(load()))
    return {
        "median_ms": statistics.median(steps) * 1000,
        "steps": len(steps),
        "threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="decode time per layout and round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each running every layout once")
    args = parser.parse_args(argv)
    runs: dict[str, list[dict[str, Any]]] = {layout: [] for layout in LAYOUTS}
    for round_ in range(args.rounds):
        for layout in LAYOUTS:
            child = [sys.executable, "-m", "bench.threads", "--child", layout, str(args.seconds)]
            done = subprocess.run(child, cwd=ROOT, capture_output=True, text=True, check=True)
            run = json.loads(done.stdout.strip().splitlines()[-1])
            runs[layout].append(run)
            say(f"round {round_ + 1}, {layout}: {run['median_ms']:.1f} ms a step over {run['steps']} steps")
    rows = {
        layout: {
            "median_ms": statistics.median(r["median_ms"] for r in rs),
            "steps": sum(r["steps"] for r in rs),
            "threads": rs[0]["threads"],
        }
        for layout, rs in runs.items()
    }
    base = rows["main thread"]["median_ms"]
    lines = [
        f"Decode step of {BATCH} sequences, SmolLM2-135M-Instruct, fp32, {rows['main thread']['threads']} "
        f"torch threads; `python -m bench.threads --seconds {args.seconds:g}`",
        "",
        "| layout | median step | steps | vs main thread |",
        "|---|---:|---:|---:|",
    ]
    for layout, row in rows.items():
        lines.append(
            f"| {layout} | {row['median_ms']:.1f} ms | {row['steps']} | {row['median_ms'] / base:.2f}× |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.write_text(text)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        print(json.dumps(decode_steps(float(sys.argv[3]))))
        sys.exit(0)
    sys.exit(main())
