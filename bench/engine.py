"""What one stage does per decode step: its milliseconds, by precision, attention path and weights.

SmolLM2-135M-Instruct as one stage, in process, no Redis: a batch of B prompts, one prefill, then
decode steps, "padded" (prompts of 100-160 tokens left-padded: a mask is passed) and "unpadded" (all
of 128 tokens: no mask). Four engines take turns, a step each, so a slow spell hits all alike:

    fp32            float32, transformers' SDPA attention (what fp32 serves with)
    bf16 before     bfloat16, transformers' SDPA attention, `nn.Linear` weights
    bf16 narrow     bfloat16, `app.partitions.attention.grouped_attention` over the cache's live
                    columns and linear weights packed for oneDNN (`app.partitions.packing`)
    bf16            the same, a step of 4 rows or more attending over the cache's whole buffers
                    with two matrix products (`StagePartition._wide_slabs`): what bf16 serves with

For each batch size: the median step, tokens/s (B / step), and the ratios of bf16 to the others;
then where a bf16 step's milliseconds go at the largest batch (torch profiler), and the greedy
agreement of bf16 with bf16 before (an argmax may flip where two logits tie at bf16 precision).

    .venv/bin/python -m bench.engine [--batches 1,16,64] [--steps 24] [--threads 1]

Writes bench/results/engine.md (and its data, engine.json).
"""

from __future__ import annotations

import argparse
import os
import random
import time
from dataclasses import dataclass, field

import torch

from app.partitions import attention
from app.partitions.layers import BatchState, StagePartition, left_pad
from bench.report import git_commit, median_ms, table, timed, write_results
from bench.systems import MODEL_DIR, say

ENGINES = (  # name, dtype, attention, linear weights packed, wide decode steps
    ("fp32", torch.float32, "sdpa", False, False),
    ("bf16 before", torch.bfloat16, "sdpa", False, False),
    ("bf16 narrow", torch.bfloat16, attention.IMPLEMENTATION, True, False),
    ("bf16", torch.bfloat16, attention.IMPLEMENTATION, True, True),
)
OTHERS = ("fp32", "bf16 before", "bf16 narrow")  # what bf16 is compared with


@dataclass
class Engine:
    name: str
    partition: StagePartition
    implementation: str
    state: BatchState | None = None
    timings: list[float] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)  # greedy choices, step by step

    def use(self) -> None:
        self.partition.config._attn_implementation = self.implementation


def prompts(batch: int, padded: bool, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [rng.randrange(100, 161) if padded else 128 for _ in range(batch)]
    return [[rng.randrange(100, 30000) for _ in range(n)] for n in lengths]


@torch.inference_mode()
def start(engine: Engine, batch: int, padded: bool = True) -> torch.Tensor:
    engine.use()
    ids, mask = left_pad(prompts(batch, padded), 0)
    engine.state = BatchState(engine.partition.config, [str(i) for i in range(batch)], mask)
    engine.timings, engine.tokens = [], []
    return engine.partition(engine.state, ids).argmax(-1)  # [B]


@torch.inference_mode()
def step(engine: Engine, tokens: torch.Tensor) -> torch.Tensor:
    assert engine.state is not None
    engine.use()
    engine.state.extend(1)
    logits: torch.Tensor | None = None

    def forward() -> None:
        nonlocal logits
        logits = engine.partition(engine.state, tokens[:, None])  # [B, 1, V]

    engine.timings.append(timed(forward))
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
    for event in prof.key_averages():
        name, self_ms = event.key, event.self_cpu_time_total / 1000
        if name in ("aten::mm", "aten::addmm") or "linear_pointwise" in name:
            kinds["linear layers (mm)"] += self_ms
        elif "scaled_dot_product" in name or name in ("aten::bmm", "aten::_softmax", "aten::masked_fill_"):
            kinds["attention"] += self_ms
        elif name.startswith("aten::"):
            kinds["other kernels"] += self_ms
    per_step = {kind: ms / steps for kind, ms in kinds.items()}
    per_step["host (Python, dispatch, profiler)"] = max(0.0, wall * 1000 / steps - sum(per_step.values()))
    per_step["step (wall)"] = wall * 1000 / steps
    return per_step


def agreement(a: Engine, b: Engine) -> tuple[int, int]:
    same = total = 0
    for row_a, row_b in zip(a.tokens, b.tokens, strict=True):
        same += sum(x == y for x, y in zip(row_a, row_b, strict=True))
        total += len(row_a)
    return same, total


def markdown(
    rows: list[tuple[int, str, dict[str, float]]], prof: dict[str, float], meta: dict[str, str]
) -> str:
    names = [name for name, *_ in ENGINES]
    lines = [
        "# Engine: one decode step, by precision and attention path",
        "",
        f"`{meta['command']}` — commit {meta['commit']}, {meta['when']}, torch threads {meta['threads']}, "
        f"load average {meta['load']}. SmolLM2-135M-Instruct, one stage, prompts of 100-160 tokens "
        "left-padded to the longest; the engines take turns step by step; medians.",
        "",
        *table(
            "batch> | rows | "
            + " | ".join(
                [f"{n} ms>" for n in names]
                + [f"{n} tok/s>" for n in names]
                + [f"bf16 vs {o}>" for o in OTHERS]
            ),
            (
                [
                    batch,
                    kind,
                    *(f"{ms[n]:.1f}" for n in names),
                    *(f"{batch / ms[n] * 1000:.0f}" for n in names),
                ]
                + [f"{ms[other] / ms['bf16']:.2f}×" for other in OTHERS]
                for batch, kind, ms in rows
            ),
        ),
        "",
        f"Where one decode step's milliseconds go ({meta['profiled']}, torch profiler; its own overhead "
        "lands in the host line):",
        "",
        *table(
            "work | ms per step> | share>",
            (
                (kind, f"{ms:.1f}", "" if kind == "step (wall)" else f"{ms / prof['step (wall)']:.0%}")
                for kind, ms in prof.items()
            ),
        ),
        "",
        f"Greedy agreement, bf16 vs bf16 before over every decode step: {meta['agreement']}.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)"
    )
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    load = f"{os.getloadavg()[0]:.1f}"

    def partition(dtype: torch.dtype, pack: bool, wide: bool) -> StagePartition:
        stage = StagePartition.load(MODEL_DIR, dtype=dtype, pack=pack)
        stage.wide_decode = wide
        stage.warmup()
        return stage

    engines = [Engine(name, partition(dtype, pack, wide), impl) for name, dtype, impl, pack, wide in ENGINES]
    rows = []
    same = total = 0
    for batch in batches:
        for padded in (True, False):
            run_batch(engines, batch, padded, args.steps)
            ms = {e.name: median_ms(e.timings) for e in engines}
            kind = "padded" if padded else "unpadded"
            say(f"batch {batch} {kind}: " + ", ".join(f"{n} {v:.1f} ms" for n, v in ms.items()))
            rows.append((batch, kind, ms))
            s, t = agreement(engines[1], engines[3])
            same, total = same + s, total + t
    profiled = max(batches)
    prof = profile(engines[3], profiled, max(4, args.steps // 3))
    say("profile: " + ", ".join(f"{k} {v:.1f}" for k, v in prof.items()))
    meta = {
        "command": f"python -m bench.engine --batches {args.batches} --steps {args.steps} "
        f"--threads {args.threads}",
        "commit": git_commit(),
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "threads": str(args.threads),
        "load": f"{load} before, {os.getloadavg()[0]:.1f} after",
        "profiled": f"bf16, batch {profiled}",
        "agreement": f"{same}/{total} tokens ({same / max(total, 1):.1%})",
    }
    text = markdown(rows, prof, meta)
    print(text)
    if not args.no_write:
        write_results(
            "engine",
            text,
            {
                "meta": meta,
                "steps": [{"batch": b, "rows": k, "ms": ms} for b, k, ms in rows],
                "profile": prof,
            },
        )


if __name__ == "__main__":
    main()
