"""One stage's steps in process: the batch engine against the step engine (`CONVEYOR_ENGINE`).

SmolLM2-135M-Instruct as one stage in the serving dtype (`--dtype auto`: bf16 where the CPU has it),
no Redis. "batch": `StagePartition` over a `BatchState`, what the batch engine's worker runs;
"step": `EngineLoop`, the scheduler's ragged step over the paged KV cache.

1. Decode: B streams of distinct 128-token prompts, prefilled, then decode steps, the two engines
   taking turns a step each, in `--rounds` interleaved rounds (a slow spell hits both alike): the
   median of the rounds' median steps (lowest-highest round), tokens/s (B / step) and the ratio,
   and each step's CPU time on this thread (what it cost, whatever else the machine ran).
2. A 2,000-token prompt arrives into 16 decoding streams. Step: it is cut into chunks of the
   token budget (`--chunk`) that share steps with the 16 decode rows; the streams' inter-token
   latency is the step time, its p99 while the prompt arrives is printed against a decode-only step
   and a chunk's own time (the median chunk's, and the longest's: a chunk late in the prompt
   attends over more of it). Batch: the prompt is one prefill the streams wait behind whole.
3. Where a step engine's decode step at the largest batch goes (torch profiler).

    .venv/bin/python -m bench.engine [--batches 1,16,64] [--steps 12] [--rounds 3] [--chunk 256]

The comparison of fp32/bf16 with separate and fused projections this script made before is at
commit dc23406 (bench/results/engine.md).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable

import torch

from app.partitions.layers import BatchState, StagePartition, left_pad
from app.partitions.precision import dtype_name, resolve_dtype
from app.workers.engine.loop import EngineLoop
from app.workers.engine.scheduler import SchedulerConfig, Seq
from bench.report import git_commit, percentile, table
from bench.systems import MODEL_DIR, say

PROMPT, LONG, BLOCK = 128, 2000, 16


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 30000) for _ in range(length)] for _ in range(count)]


def clocked(fn: Callable[[], object]) -> tuple[float, float]:
    """Seconds one call took: wall clock, and this thread's CPU time."""
    wall, cpu = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - wall, time.thread_time() - cpu


def loop_for(stage: StagePartition, streams: int, budget: int, extra: int = 0) -> EngineLoop:
    blocks = streams * -(-(PROMPT + 256) // BLOCK) + -(-(extra + 256) // BLOCK)
    config = SchedulerConfig(
        blocks, BLOCK, max_num_seqs=streams + 1, max_num_batched_tokens=max(budget, streams + 1)
    )
    return EngineLoop([stage], config)


@torch.inference_mode()
def decode_round(
    stage: StagePartition, streams: int, steps: int, seed: int
) -> dict[str, list[tuple[float, float]]]:
    """`steps` decode steps of `streams` rows on each engine, taking turns: (wall, CPU) s per step."""
    ps = prompts(streams, PROMPT, seed)
    x, mask = left_pad(ps, 0)
    state = BatchState(stage.config, [str(i) for i in range(streams)], mask)
    tokens = [stage(state, x).argmax(-1)]
    loop = loop_for(stage, streams, PROMPT * streams)
    for i, p in enumerate(ps):
        loop.add(Seq(str(i), tuple(p), steps + 2))
    loop.step()  # every prompt in one step

    def batch_step() -> None:
        state.extend(1)
        tokens[0] = stage(state, tokens[0][:, None]).argmax(-1)

    times: dict[str, list[tuple[float, float]]] = {"batch": [], "step": []}
    for _ in range(steps):
        times["batch"].append(clocked(batch_step))
        times["step"].append(clocked(loop.step))
    return times


def long_prompt(stage: StagePartition, streams: int, chunk: int) -> dict[str, float]:
    """The step engine's ITL for `streams` decoding rows while a LONG-token prompt arrives, and the
    batch engine's stall: the prompt's whole prefill."""
    loop = loop_for(stage, streams, chunk, LONG)
    for i, p in enumerate(prompts(streams, PROMPT, 7)):
        loop.add(Seq(str(i), tuple(p), 400))
    while any(len(r.tokens) > 1 for r in loop.step().plan.rows):
        pass  # until every stream decodes
    quiet = [clocked(loop.step)[0] for _ in range(8)]
    long = prompts(1, LONG, 8)[0]
    loop.add(Seq("long", tuple(long), 4))
    during, chunks = [], 0
    while loop.scheduler.sequences["long"].computed < LONG:
        started = time.perf_counter()
        plan = loop.step().plan
        during.append(time.perf_counter() - started)
        chunks += any(r.seq_id == "long" for r in plan.chunks)
    x, mask = left_pad([long], 0)
    whole, _ = clocked(lambda: stage(BatchState(stage.config, ["long"], mask), x))
    decode = statistics.median(quiet)
    p99 = percentile(during, 99) or 0.0
    return {
        "decode": decode,
        "p99": p99,
        "chunk": statistics.median(during) - decode,
        "longest": max(during) - decode,  # a chunk late in the prompt attends over more of it
        "whole": whole,
        "chunks": chunks,
    }


def profile(stage: StagePartition, streams: int, steps: int) -> str:
    """Where a step engine's decode step goes: the top operators by self CPU time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    loop = loop_for(stage, streams, PROMPT * streams)
    for i, p in enumerate(prompts(streams, PROMPT, 3)):
        loop.add(Seq(str(i), tuple(p), steps + 4))
    for _ in range(3):
        loop.step()
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            loop.step()
    return str(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10))


def spread(samples: list[float]) -> str:
    return f"{statistics.median(samples):.1f} ({min(samples):.1f}-{max(samples):.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=256, help="the step engine's token budget")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    dtype = resolve_dtype(args.dtype, "cpu")
    stage = StagePartition.load(MODEL_DIR, dtype=dtype)
    stage.warmup()
    load = f"{os.getloadavg()[0]:.1f}"
    rows = []
    for streams in [int(b) for b in args.batches.split(",")]:
        wall: dict[str, list[float]] = {"batch": [], "step": []}
        cpu: dict[str, list[float]] = {"batch": [], "step": []}
        for round_ in range(args.rounds):
            for engine, samples in decode_round(stage, streams, args.steps, round_).items():
                wall[engine].append(statistics.median(w for w, _ in samples) * 1e3)
                cpu[engine].append(statistics.median(c for _, c in samples) * 1e3)
            say(
                f"{streams} streams, round {round_ + 1}: "
                f"batch {wall['batch'][-1]:.1f} ms, step {wall['step'][-1]:.1f} ms"
            )
        b, s = statistics.median(wall["batch"]), statistics.median(wall["step"])
        cb, cs = statistics.median(cpu["batch"]), statistics.median(cpu["step"])
        rows.append(
            [
                streams,
                spread(wall["batch"]),
                spread(wall["step"]),
                f"{streams * 1e3 / b:.1f}",
                f"{streams * 1e3 / s:.1f}",
                f"{b / s:.2f}×",
                f"{cb:.1f}",
                f"{cs:.1f}",
                f"{cb / cs:.2f}×",
            ]
        )
    got = long_prompt(stage, 16, args.chunk)
    print(
        f"`python -m bench.engine --batches {args.batches} --steps {args.steps} --rounds {args.rounds} "
        f"--chunk {args.chunk}`: commit {git_commit()}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"SmolLM2-135M-Instruct, one stage, {dtype_name(dtype)}, torch threads {torch.get_num_threads()}, "
        f"load average {load} before, {os.getloadavg()[0]:.1f} after.\n"
    )
    columns = (
        "streams> | batch ms> | step ms> | batch tok/s> | step tok/s> | step / batch> | batch CPU ms> | "
    )
    print("\n".join(table(columns + "step CPU ms> | step / batch (CPU)>", rows)))
    print(
        f"\nA {LONG}-token prompt into 16 decoding streams, chunks of {args.chunk} tokens "
        f"({got['chunks']:.0f} steps carried one): step engine ITL {got['decode'] * 1e3:.1f} ms "
        f"decode-only, p99 "
        f"{got['p99'] * 1e3:.1f} ms while it arrives (+{(got['p99'] - got['decode']) * 1e3:.1f} ms; one "
        f"chunk's own time {got['chunk'] * 1e3:.1f} ms, the longest's {got['longest'] * 1e3:.1f} ms); "
        f"the batch engine's streams wait behind its whole "
        f"prefill, {got['whole'] * 1e3:.0f} ms.\n"
    )
    print(profile(stage, max(int(b) for b in args.batches.split(",")), 4))


if __name__ == "__main__":
    main()
