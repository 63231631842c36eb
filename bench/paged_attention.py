"""One layer's decode attention: the paged cache (`app.partitions.paged`) against the stages' today.

SmolLM2's attention shapes (9 query heads, 3 key/value heads, head dim 64), B decode rows of
170-210 live positions each (about 190), one query token a row:

    today   `app.partitions.attention.grouped_attention` as a stage calls it: in bf16 over the
            KV cache's whole buffers (256 columns, `SlabLayer.wide_views`) with a mask, in fp32
            transformers' SDPA over the live columns (views of the same buffers, rows left-padded
            to the longest)
    paged   `ragged_attention` over block pools of 16-position blocks in scattered order, each
            row's blocks gathered; its `Ragged` layout is built once a step for every layer and
            timed apart (`layout`)

The two take turns, call by call. Prints the median ms per call, paged / today of the medians and
of the fastest calls (above 1: paged is slower), and the layout's median ms.

    .venv/bin/python -m bench.paged_attention [--rows 16,64] [--calls 200] [--threads 1]
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from types import SimpleNamespace

import torch

from app.partitions import attention
from app.partitions.paged import LayerAttention, PagedCache, Ragged, ragged_attention
from bench.report import median_ms, table, timed

HEADS, KV_HEADS, DIM = 9, 3, 64
BLOCK = 16
COLUMNS = 256  # today's buffer: 190 live columns and the spare room a reallocation leaves
MODULE = SimpleNamespace(num_key_value_groups=HEADS // KV_HEADS, is_causal=True)


def lengths(rows: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(170, 210) for _ in range(rows)]


def today(rows: int, dtype: torch.dtype) -> Callable[[], torch.Tensor]:
    """One decode step's attention call as a stage makes it on this CPU today."""
    g = torch.Generator().manual_seed(1)
    live = lengths(rows)
    longest = max(live)
    k = torch.randn(rows, KV_HEADS, COLUMNS, DIM, generator=g).to(dtype)
    v = torch.randn(rows, KV_HEADS, COLUMNS, DIM, generator=g).to(dtype)
    q = torch.randn(rows, HEADS, 1, DIM, generator=g).to(dtype)
    start = 8  # where the batch's history starts in the buffer (columns trimmed or reallocated)
    if dtype in attention.HALF:  # the whole buffers, the mask excluding all but each row's history
        mask = torch.zeros(rows, COLUMNS, dtype=torch.bool)
        for row, n in enumerate(live):
            mask[row, start + longest - n : start + longest] = True
        keys, values = k, v
    else:  # the live columns, left-padded rows
        mask = torch.zeros(rows, longest, dtype=torch.bool)
        for row, n in enumerate(live):
            mask[row, longest - n :] = True
        keys, values = k[:, :, start : start + longest], v[:, :, start : start + longest]
    scale = DIM**-0.5

    def call() -> torch.Tensor:
        out, _ = attention.grouped_attention(MODULE, q, keys, values, mask[:, None, None, :], scaling=scale)  # type: ignore[arg-type]
        return out

    return call


def paged(rows: int, dtype: torch.dtype) -> tuple[Callable[[], torch.Tensor], Callable[[], Ragged]]:
    """The same rows over a paged cache: the attention call, and the step layout's build."""
    g = torch.Generator().manual_seed(2)
    live = lengths(rows)
    num_blocks = sum(-(-n // BLOCK) for n in live) + 64
    cache = PagedCache(
        [0], num_blocks=num_blocks, block_size=BLOCK, kv_heads=KV_HEADS, head_dim=DIM, dtype=dtype
    )
    cache.keys[0].copy_(torch.randn(cache.keys[0].shape, generator=g))
    cache.values[0].copy_(torch.randn(cache.values[0].shape, generator=g))
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[order.pop() for _ in range(-(-n // BLOCK))] for n in live]
    q = torch.randn(rows, HEADS, DIM, generator=g).to(dtype)
    layer = LayerAttention(DIM**-0.5)

    def layout() -> Ragged:
        return Ragged.build([1] * rows, live, tables, BLOCK)

    step = layout()

    def call() -> torch.Tensor:
        return ragged_attention(q, cache.keys[0], cache.values[0], step, layer)

    return call, layout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="16,64", help="decode rows per step, comma-separated")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(
        f"one layer's decode attention, {HEADS} heads / {KV_HEADS} KV heads / dim {DIM}, ~190 positions a row"
    )
    cells = []
    for dtype in (torch.bfloat16, torch.float32):
        for rows in [int(r) for r in args.rows.split(",")]:
            before = today(rows, dtype)
            after, layout = paged(rows, dtype)
            times: dict[str, list[float]] = {"today": [], "paged": [], "layout": []}
            with torch.inference_mode():
                for _ in range(10):  # warm-up
                    before(), after()
                for _ in range(args.calls):
                    times["today"].append(timed(before))
                    times["paged"].append(timed(after))
                    times["layout"].append(timed(layout))
            t, p, lay = (median_ms(times[k]) for k in ("today", "paged", "layout"))
            best = min(times["paged"]) / min(times["today"])
            ms = (f"{x:.3f}" for x in (t, p))
            cells.append(
                (str(dtype).removeprefix("torch."), rows, *ms, f"{p / t:.2f}", f"{best:.2f}", f"{lay:.3f}")
            )
    columns = "dtype | rows> | today ms> | paged ms> | paged/today> | best ratio> | layout ms>"
    print("\n".join(table(columns, cells)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
