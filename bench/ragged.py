"""The step engine against the stages' batch path, in process: decode steps, and a long prompt
arriving into running streams.

SmolLM2-135M-Instruct as one stage, no Redis, one thread's worth of torch as the worker runs it.

1. Decode: B streams, each a distinct 128-token prompt already prefilled, one decode step timed at
   a time, the two paths taking turns ("batch": `StagePartition` over a `BatchState`, what the stage
   worker runs today; "ragged": `EngineLoop`, the scheduler's ragged step over the paged cache).
   Median step, tokens/s (B / step), and the ratio.
2. A 2,000-token prompt arrives into 16 decoding streams. Ragged: it is cut into chunks of the
   token budget that share steps with the 16 decode rows; the streams' inter-token latency (ITL) is
   the step time, and its p99 over the prompt's arrival is printed against a decode-only step and
   against one chunk's own time. Batch: the prompt is one prefill the streams wait behind whole.

    .venv/bin/python -m bench.ragged [--batches 1,16,64] [--steps 16] [--chunk 256] [--dtype auto]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from app.partitions.layers import BatchState, StagePartition, left_pad
from app.partitions.precision import dtype_name, resolve_dtype
from app.workers.engine.loop import EngineLoop
from app.workers.engine.scheduler import SchedulerConfig, Seq
from bench.systems import MODEL_DIR, say

PROMPT = 128
LONG = 2000


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(count)]


def engine(stage: StagePartition, streams: int, chunk: int, extra_tokens: int) -> EngineLoop:
    blocks = streams * -(-(PROMPT + 256) // 16) + -(-(extra_tokens + 256) // 16)
    config = SchedulerConfig(
        num_blocks=blocks,
        block_size=16,
        max_num_seqs=streams + 1,
        max_num_batched_tokens=max(chunk, streams + 1),
    )
    return EngineLoop([stage], config)


def decode_steps(stage: StagePartition, streams: int, steps: int) -> tuple[list[float], list[float]]:
    """Seconds a decode step of `streams` rows: the batch path's, then the ragged path's, alternating."""
    ps = prompts(streams, PROMPT, streams)
    x, mask = left_pad(ps, 0)
    state = BatchState(stage.config, [str(i) for i in range(streams)], mask)
    tokens = stage(state, x).argmax(-1)
    loop = engine(stage, streams, PROMPT * streams, 0)
    for i, p in enumerate(ps):
        loop.add(Seq(str(i), tuple(p), steps + 2))
    loop.step()  # every prompt in one step
    batch, ragged = [], []
    for _ in range(steps):
        state.extend(1)
        started = time.perf_counter()
        tokens = stage(state, tokens[:, None]).argmax(-1)
        batch.append(time.perf_counter() - started)
        started = time.perf_counter()
        loop.step()
        ragged.append(time.perf_counter() - started)
    return batch, ragged


def long_prompt(stage: StagePartition, streams: int, chunk: int) -> dict[str, float]:
    """ITL of `streams` decoding rows while a LONG-token prompt arrives (ragged), and the batch path's
    stall: its whole prefill."""
    loop = engine(stage, streams, chunk, LONG)
    for i, p in enumerate(prompts(streams, PROMPT, 7)):
        loop.add(Seq(str(i), tuple(p), 400))
    while any(r.seq_id != "long" and len(r.tokens) > 1 for r in loop.step().plan.rows):
        pass  # until every stream decodes
    quiet = []
    for _ in range(8):
        started = time.perf_counter()
        loop.step()
        quiet.append(time.perf_counter() - started)
    loop.add(Seq("long", tuple(prompts(1, LONG, 8)[0]), 4))
    during, chunks = [], 0
    while loop.scheduler.sequences["long"].computed < LONG:
        started = time.perf_counter()
        plan = loop.step().plan
        during.append(time.perf_counter() - started)
        chunks += any(r.seq_id == "long" for r in plan.chunks)
    x, mask = left_pad([prompts(1, LONG, 8)[0]], 0)
    started = time.perf_counter()
    stage(BatchState(stage.config, ["long"], mask), x)
    whole = time.perf_counter() - started
    decode = statistics.median(quiet)
    p99 = sorted(during)[max(0, round(0.99 * len(during)) - 1)]
    return {
        "decode": decode,
        "p99": p99,
        "chunk": statistics.median(during) - decode,
        "whole": whole,
        "chunks": chunks,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=256, help="the token budget of a ragged step")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    dtype = resolve_dtype(args.dtype, "cpu")
    stage = StagePartition.load(MODEL_DIR, dtype=dtype)
    stage.warmup()
    say(f"SmolLM2-135M, one stage, {dtype_name(dtype)}, torch threads {torch.get_num_threads()}")
    print("| streams | batch step ms | ragged step ms | batch tok/s | ragged tok/s | ragged / batch tok/s |")
    print("|---:|---:|---:|---:|---:|---:|")
    for streams in [int(b) for b in args.batches.split(",")]:
        batch, ragged = decode_steps(stage, streams, args.steps)
        b, r = statistics.median(batch), statistics.median(ragged)
        cells = [f"{b * 1e3:.1f}", f"{r * 1e3:.1f}", f"{streams / b:.1f}", f"{streams / r:.1f}"]
        cells.append(f"{b / r:.2f}x")
        print(f"| {streams} | " + " | ".join(cells) + " |")
    got = long_prompt(stage, 16, args.chunk)
    print(
        f"\nA {LONG}-token prompt into 16 decoding streams, chunks of {args.chunk} tokens "
        f"({got['chunks']:.0f} steps carried a chunk):\n"
        f"- ragged: ITL {got['decode'] * 1e3:.1f} ms decode-only, p99 {got['p99'] * 1e3:.1f} ms while it "
        f"arrives: raised by {(got['p99'] - got['decode']) * 1e3:.1f} ms, one chunk's time "
        f"{got['chunk'] * 1e3:.1f} ms (median step with a chunk, less a decode-only step)\n"
        f"- batch: the streams wait behind its whole prefill, {got['whole'] * 1e3:.0f} ms"
    )


if __name__ == "__main__":
    main()
