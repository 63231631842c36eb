"""A long prefill arriving while streams decode: how long the running streams wait, and what it costs
the prefill, with the prefill given way every slice (`CONVEYOR_PREFILL_SLICE_MS`) or run whole.

SmolLM2-135M-Instruct as one stage on a stage worker's compute thread (`app.workers.compute`), in
process, no Redis, one torch thread: a lane-like thread runs decode steps of a running batch of
`--rows` sequences back to back (each handed to the compute thread, as the lane consumer does),
and a prefill of `--prompts` prompts of `--tokens` tokens is handed over while they run. For each
setting: the longest gap between two decode steps (what every running stream waits between two
tokens), the median gap, and the prefill's time from hand-over to its end (the new jobs' time to
first token here).

    python -m bench.interleave [--dtype bfloat16] [--rows 16] [--prompts 4] [--tokens 512] [--slices 0,100,50]

`--slices` in ms; 0 runs the prefill whole (what `CONVEYOR_PREFILL_SLICE_MS=0` does). Writes
bench/results/interleave-cpu-<dtype>.md and .json (`--out DIR` writes there instead).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
from pathlib import Path

import torch

from app.partitions.layers import BatchState, StagePartition, left_pad
from app.workers.compute import ComputeThread
from bench.report import RESULTS_DIR, in_process_meta, write_results
from bench.systems import MODEL_DIR

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def prompts(count: int, tokens: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 30000) for _ in range(tokens)] for _ in range(count)]


def measure(stage: StagePartition, compute: ComputeThread, args: argparse.Namespace, slice_ms: float) -> dict:
    ids, mask = left_pad(prompts(args.rows, 128, seed=1), 0)
    running = BatchState(stage.config, [f"r{i}" for i in range(args.rows)], mask)
    compute.call(lambda: stage(running, ids))  # the running batch's prefill
    feed = torch.ones(args.rows, 1, dtype=torch.long)

    def decode_step():  # type: ignore[no-untyped-def]
        running.extend(1)
        yield from stage.steps(running, feed)

    finished: list[float] = []
    stop = threading.Event()

    def lane() -> None:
        while not stop.is_set():
            compute.call(decode_step)
            finished.append(time.perf_counter())

    thread = threading.Thread(target=lane)
    thread.start()
    while len(finished) < 5:
        time.sleep(0.005)
    new_ids, new_mask = left_pad(prompts(args.prompts, args.tokens, seed=2), 0)
    state = BatchState(stage.config, [f"n{i}" for i in range(args.prompts)], new_mask)
    handed = time.perf_counter()
    compute.call(lambda: stage.steps(state, new_ids), slice_s=slice_ms / 1000 if slice_ms else None)
    prefill_s = time.perf_counter() - handed
    after = len(finished)
    while len(finished) < after + 3:
        time.sleep(0.005)
    stop.set()
    thread.join()
    gaps = [b - a for a, b in zip(finished, finished[1:], strict=False)]
    return {
        "slice_ms": slice_ms,
        "longest_gap_ms": max(gaps) * 1000,
        "median_gap_ms": statistics.median(gaps) * 1000,
        "prefill_ms": prefill_s * 1000,
        "steps_during_prefill": sum(1 for t in finished if handed < t < handed + prefill_s),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--slices", default="0,100,50")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", type=Path, default=MODEL_DIR)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    compute = ComputeThread()
    compute.start()

    def load() -> StagePartition:
        torch.set_num_threads(args.threads)
        stage = StagePartition.load(args.model, dtype=DTYPES[args.dtype])
        stage.warmup()
        return stage

    stage = compute.call(load)
    rows = []
    for slice_ms in (float(s) for s in args.slices.split(",")):
        row = measure(stage, compute, args, slice_ms)
        print(json.dumps(row), flush=True)
        rows.append(row)
    compute.stop()
    meta = in_process_meta(
        f"python -m bench.interleave --dtype {args.dtype} --rows {args.rows} --prompts "
        f"{args.prompts} --tokens {args.tokens} --slices {args.slices} --threads {args.threads}"
    )
    text = markdown(rows, meta, args)
    print(text)
    write_results(f"interleave-cpu-{args.dtype}", text, {"meta": meta, "rows": rows}, args.out)


def markdown(rows: list[dict], meta: dict[str, str], args: argparse.Namespace) -> str:
    lines = [
        f"# A prefill of {args.prompts} x {args.tokens} tokens while {args.rows} streams decode",
        "",
        f"`{meta['command']}` ({meta['when']}, torch {meta['torch']}, load {meta['load']})",
        "",
        "| prefill slice | longest gap between tokens | median gap | prefill time | decode steps during it |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        name = "whole (0)" if not r["slice_ms"] else f"{r['slice_ms']:.0f} ms"
        lines.append(
            f"| {name} | {r['longest_gap_ms']:.0f} ms | {r['median_gap_ms']:.0f} ms | "
            f"{r['prefill_ms']:.0f} ms | {r['steps_during_prefill']} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
