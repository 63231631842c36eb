"""What one stage does per step: decode and prefill milliseconds, by precision, before and after a change.

SmolLM2-135M-Instruct as one stage, in process, no Redis: a batch of B prompts, one prefill (timed:
at B = 1 unpadded, one 128-token prefill), then decode steps, "padded" (prompts of 100-160 tokens
left-padded: a mask is passed) and "unpadded" (all of 128 tokens: no mask). The engines take turns,
a step each, so a slow spell hits all alike, and the whole run repeats `--rounds` times:

    fp32            float32, separate q/k/v and gate/up projections: what fp32 serves with
    fp32 fused      float32, q/k/v and gate/up each one product (`app.partitions.fusion`)
    bf16 before     bfloat16, separate projections, linear weights packed for oneDNN
                    (`app.partitions.packing`)
    bf16            bfloat16, fused projections, packed: what bf16 serves with

For each batch size: the median step over the rounds' medians, its spread (lowest-highest round),
the same steps' CPU time, the ratio of each fused engine to its separate one; the prefill; then
where a bf16 step's milliseconds go at the smallest and largest batch (torch profiler: the host line
is the Python and dispatch work per step), and the greedy agreement of each pair.

    .venv/bin/python -m bench.engine [--batches 1,16,64] [--steps 24] [--rounds 3] [--rows unpadded]

Writes bench/results/engine.md (and its data, engine.json).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from app.partitions import attention
from app.partitions.layers import BatchState, StagePartition, left_pad
from bench.report import git_commit, median_ms, table, write_results
from bench.systems import MODEL_DIR, say

ENGINES = (  # name, dtype, linear weights packed, projections fused
    ("fp32", torch.float32, False, False),
    ("fp32 fused", torch.float32, False, True),
    ("bf16 before", torch.bfloat16, True, False),
    ("bf16", torch.bfloat16, True, True),
)
PAIRS = (("fp32 fused", "fp32"), ("bf16", "bf16 before"))  # (after, before)


@dataclass
class Engine:
    name: str
    partition: StagePartition
    state: BatchState | None = None
    timings: list[float] = field(default_factory=list)  # seconds a decode step, wall clock
    cpu: list[float] = field(default_factory=list)  # the same steps' CPU seconds (this thread's)
    prefill: list[tuple[float, float]] = field(default_factory=list)  # (wall, CPU) s, one per batch run
    tokens: list[list[int]] = field(default_factory=list)  # greedy choices, step by step


def prompts(batch: int, padded: bool, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [rng.randrange(100, 161) if padded else 128 for _ in range(batch)]
    return [[rng.randrange(100, 30000) for _ in range(n)] for n in lengths]


def clocked(fn: Callable[[], object]) -> tuple[float, float]:
    """Seconds one call of `fn` took: wall clock, and CPU time of this thread. With one torch thread
    every kernel runs on it, so the second is what the step cost, whatever else the machine ran."""
    wall, cpu = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - wall, time.thread_time() - cpu


@torch.inference_mode()
def start(engine: Engine, batch: int, padded: bool = True) -> torch.Tensor:
    ids, mask = left_pad(prompts(batch, padded), 0)
    engine.state = BatchState(engine.partition.config, [str(i) for i in range(batch)], mask)
    engine.timings, engine.cpu, engine.tokens = [], [], []
    logits: torch.Tensor | None = None

    def forward() -> None:
        nonlocal logits
        logits = engine.partition(engine.state, ids)

    engine.prefill.append(clocked(forward))
    assert logits is not None
    return logits.argmax(-1)  # [B]


@torch.inference_mode()
def step(engine: Engine, tokens: torch.Tensor) -> torch.Tensor:
    assert engine.state is not None
    engine.state.extend(1)
    logits: torch.Tensor | None = None

    def forward() -> None:
        nonlocal logits
        logits = engine.partition(engine.state, tokens[:, None])  # [B, 1, V]

    wall, cpu = clocked(forward)
    engine.timings.append(wall)
    engine.cpu.append(cpu)
    assert logits is not None
    chosen = logits.argmax(-1)
    engine.tokens.append(chosen.tolist())
    return chosen  # type: ignore[no-any-return]


def run_batch(engines: list[Engine], batch: int, padded: bool, steps: int) -> None:
    """Prefill each engine's batch, then `steps` decode steps, the engines taking turns. Every
    engine is fed the first engine's greedy tokens, so all of them step over the same history."""
    feed = [start(e, batch, padded) for e in engines][0]
    for _ in range(steps):
        feed = [step(e, feed) for e in engines][0]


def profile(engine: Engine, batch: int, steps: int) -> dict[str, float]:
    """Milliseconds per step by kind of work, from torch's profiler over `steps` decode steps."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    feed = start(engine, batch)
    for _ in range(3):
        feed = step(engine, feed)
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        started = time.perf_counter()
        for _ in range(steps):
            feed = step(engine, feed)
        wall = time.perf_counter() - started
    kinds: dict[str, float] = {"linear layers (mm)": 0.0, "attention": 0.0, "other kernels": 0.0}
    ops = 0
    for event in prof.key_averages():
        name, self_ms = event.key, event.self_cpu_time_total / 1000
        ops += event.count if name.startswith("aten::") else 0
        if name in ("aten::mm", "aten::addmm") or "linear_pointwise" in name:
            kinds["linear layers (mm)"] += self_ms
        elif "scaled_dot_product" in name or name in ("aten::bmm", "aten::_softmax", "aten::masked_fill_"):
            kinds["attention"] += self_ms
        elif name.startswith("aten::"):
            kinds["other kernels"] += self_ms
    per_step = {kind: ms / steps for kind, ms in kinds.items()}
    per_step["host (Python, dispatch, profiler)"] = max(0.0, wall * 1000 / steps - sum(per_step.values()))
    per_step["step (wall)"] = wall * 1000 / steps
    per_step["aten ops (count)"] = ops / steps
    return per_step


def agreement(a: Engine, b: Engine) -> tuple[int, int]:
    same = total = 0
    for row_a, row_b in zip(a.tokens, b.tokens, strict=True):
        same += sum(x == y for x, y in zip(row_a, row_b, strict=True))
        total += len(row_a)
    return same, total


def spread(samples: list[float]) -> str:
    """A median over rounds with its lowest-highest, in ms."""
    return f"{statistics.median(samples):.1f} ({min(samples):.1f}-{max(samples):.1f})"


Times = dict[str, list[float]]  # engine -> ms, one per round


def markdown(
    rows: list[tuple[int, str, Times, Times, Times, Times]],
    profs: dict[str, dict[str, float]],
    meta: dict[str, str],
) -> str:
    names = [name for name, *_ in ENGINES]
    mid = statistics.median
    columns = (
        " | ".join([f"{n} ms>" for n in names] + [f"{n} CPU ms>" for n in names])
        + " | "
        + " | ".join(f"{a} vs {b}> | (CPU)>" for a, b in PAIRS)
    )

    def cells(wall: Times, cpu: Times) -> list[str]:
        ratios = [f"{mid(t[b]) / mid(t[a]):.2f}×" for a, b in PAIRS for t in (wall, cpu)]
        return [*(spread(wall[n]) for n in names), *(spread(cpu[n]) for n in names), *ratios]

    lines = [
        "# Engine: one step, decode and prefill, before and after",
        "",
        f"`{meta['command']}` — commit {meta['commit']}, {meta['when']}, torch threads {meta['threads']}, "
        f"load average {meta['load']}. SmolLM2-135M-Instruct, one stage, prompts of 100-160 tokens "
        "left-padded to the longest (padded) or all of 128 (unpadded); the engines take turns step by "
        f"step, {meta['rounds']} rounds. ms: wall clock, the median of the rounds' median steps "
        "(lowest-highest round); CPU ms: the same steps' CPU time on the one torch thread (what a step "
        "costs, whatever else the machine runs).",
        "",
        "Decode steps:",
        "",
        *table(
            "batch> | rows | " + columns,
            ([batch, kind, *cells(ms, cpu)] for batch, kind, ms, cpu, _, _ in rows),
        ),
        "",
        "Prefill (the whole batch's prompts in one step; unpadded rows: B × 128 tokens):",
        "",
        *table(
            "batch> | tokens> | " + columns,
            (
                [batch, batch * 128, *cells(pre, pre_cpu)]
                for batch, kind, _, _, pre, pre_cpu in rows
                if kind == "unpadded"
            ),
        ),
        "",
        "Where one decode step's milliseconds go (padded rows, torch profiler; its own overhead lands in "
        "the host line, and every aten op counts, nested ones too):",
        "",
        *table(
            "work | " + " | ".join(f"{name} ms> | share>" for name in profs),
            (
                [kind]
                + [
                    cell
                    for prof in profs.values()
                    for cell in (
                        f"{prof[kind]:.1f}" if "count" not in kind else f"{prof[kind]:.0f}",
                        ""
                        if kind in ("step (wall)", "aten ops (count)")
                        else f"{prof[kind] / prof['step (wall)']:.0%}",
                    )
                ]
                for kind in next(iter(profs.values()))
            ),
        ),
        "",
        f"Greedy agreement over every decode step: {meta['agreement']}.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", default="padded,unpadded", help="padded, unpadded or both")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)"
    )
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    load = f"{os.getloadavg()[0]:.1f}"

    def partition(dtype: torch.dtype, pack: bool, fuse: bool) -> StagePartition:
        stage = StagePartition.load(MODEL_DIR, dtype=dtype, pack=pack, fuse=fuse)
        assert stage.config._attn_implementation == attention.IMPLEMENTATION
        stage.warmup()
        return stage

    engines = [Engine(name, partition(dtype, pack, fuse)) for name, dtype, pack, fuse in ENGINES]
    by_name = {e.name: e for e in engines}
    kinds = args.rows.split(",")
    cases = [
        (b, padded)
        for b in batches
        for padded in (True, False)
        if ("padded" if padded else "unpadded") in kinds
    ]
    steps: dict[tuple[int, bool], dict[str, list[float]]] = {c: {e.name: [] for e in engines} for c in cases}
    prefill_cpu: dict[tuple[int, bool], dict[str, list[float]]] = {
        c: {e.name: [] for e in engines} for c in cases
    }
    cpu: dict[tuple[int, bool], dict[str, list[float]]] = {c: {e.name: [] for e in engines} for c in cases}
    prefill: dict[tuple[int, bool], dict[str, list[float]]] = {
        c: {e.name: [] for e in engines} for c in cases
    }
    agree = {pair: [0, 0] for pair in PAIRS}
    for round_ in range(args.rounds):
        for batch, padded in cases:
            run_batch(engines, batch, padded, args.steps)
            for e in engines:
                steps[batch, padded][e.name].append(median_ms(e.timings))
                cpu[batch, padded][e.name].append(median_ms(e.cpu))
                prefill[batch, padded][e.name].append(e.prefill[-1][0] * 1000)
                prefill_cpu[batch, padded][e.name].append(e.prefill[-1][1] * 1000)
            say(
                f"round {round_ + 1} batch {batch} {'padded' if padded else 'unpadded'}: "
                + ", ".join(f"{e.name} {median_ms(e.timings):.1f} ms" for e in engines)
            )
            for pair in PAIRS:
                s, t = agreement(by_name[pair[0]], by_name[pair[1]])
                agree[pair][0] += s
                agree[pair][1] += t
    rows = [
        (b, "padded" if p else "unpadded", steps[b, p], cpu[b, p], prefill[b, p], prefill_cpu[b, p])
        for b, p in cases
    ]
    profs = {
        f"{name}, batch {batch}": profile(by_name[name], batch, max(4, args.steps // 3))
        for batch in sorted({min(batches), max(batches)})
        for name in ("bf16 before", "bf16")
    }
    for name, prof in profs.items():
        say(f"profile {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in prof.items()))
    meta = {
        "command": f"python -m bench.engine --batches {args.batches} --steps {args.steps} "
        f"--rounds {args.rounds} --rows {args.rows} --threads {args.threads}",
        "commit": git_commit(),
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "threads": str(args.threads),
        "rounds": str(args.rounds),
        "load": f"{load} before, {os.getloadavg()[0]:.1f} after",
        "agreement": "; ".join(
            f"{a} vs {b} {s}/{t} tokens ({s / max(t, 1):.1%})" for (a, b), (s, t) in agree.items()
        ),
    }
    text = markdown(rows, profs, meta)
    print(text)
    if not args.no_write:
        write_results(
            "engine",
            text,
            {
                "meta": meta,
                "steps": [
                    {"batch": b, "rows": k, "ms": ms, "cpu_ms": c, "prefill_ms": pre, "prefill_cpu_ms": pc}
                    for b, k, ms, c, pre, pc in rows
                ],
                "profile": profs,
            },
        )


if __name__ == "__main__":
    main()
