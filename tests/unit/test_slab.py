"""The decode rows' slab (`app.partitions.slab`): over many steps of sequences that start decoding,
decode, skip a step, leave and are replaced, grow past the slab's positions and slots, and shrink to
a few rows again, every decode row's attention read from the slab is the one read from its blocks
in the paged pools, in fp32 and in bf16 (whose rows take the matrix products), with and without a
sliding window and soft-capping, with prefill chunks beside the decode rows."""

from __future__ import annotations

import random

import pytest
import torch

from app.partitions.paged import WIDE_MIN_ROWS, LayerAttention, PagedCache, Ragged, ragged_attention

BLOCK, BLOCKS, HEADS, KV_HEADS, DIM = 4, 400, 6, 2, 16


def written(
    cache: PagedCache, step: Ragged, g: torch.Generator, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's new keys and values [T, kv heads, D], written to the pools."""
    key = torch.randn(step.num_tokens, KV_HEADS, DIM, generator=g).to(dtype)
    value = torch.randn(step.num_tokens, KV_HEADS, DIM, generator=g).to(dtype)
    cache.write(0, key, value, step.slots)
    return key, value


def larger(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return any(x > y for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "layer",
    [LayerAttention(DIM**-0.5), LayerAttention(DIM**-0.5, window=7), LayerAttention(DIM**-0.5, softcap=5.0)],
    ids=["whole", "window", "softcap"],
)
def test_decode_rows_read_from_the_slab_what_their_blocks_hold(
    dtype: torch.dtype, layer: LayerAttention
) -> None:
    rng, g = random.Random(3), torch.Generator().manual_seed(3)
    cache = PagedCache([0], num_blocks=BLOCKS, block_size=BLOCK, kv_heads=KV_HEADS, head_dim=DIM, dtype=dtype)
    free = list(range(1, BLOCKS))
    rng.shuffle(free)
    live: dict[str, tuple[int, list[int]]] = {}  # sequence -> positions written, blocks
    counter = 0
    seen = {"slab": 0, "pools": 0, "unordered": 0, "grown": 0, "anew": 0}
    shapes: set[tuple[int, int]] = set()
    for step_no in range(90):
        # arrivals: many early (past the slab's first slots), few late (the slab shrinks anew)
        target = 14 if step_no < 45 else 5 if step_no < 70 else 2
        while len(live) < target:
            counter += 1
            prompt = rng.choice([1, 2, 5, 9, 16, 23])
            live[f"s{counter}"] = (prompt - 1, [])  # its prompt but the last token is in the pools
        for seq_id in list(live):
            if rng.random() < 0.06:
                free += live.pop(seq_id)[1]  # leaves: a hole in the slab, its blocks for others
        decoding = [s for s in live if rng.random() < 0.9]  # the others skip this step
        rows, lens, tables = [], [], []
        for seq_id in decoding:
            n, table = live[seq_id]
            n += 1
            while len(table) * BLOCK < n:
                table.append(free.pop())
            live[seq_id] = (n, table)
            rows.append(seq_id)
            lens.append(n)
            tables.append(list(table))
        chunk = rng.random() < 0.3  # a prefill chunk beside the decode rows
        queries = [1] * len(rows) + ([3] if chunk else [])
        if chunk:
            lens.append(6)
            tables.append([free.pop(), free.pop()])
            rows.append("chunk")
        # a sequence's earlier positions are in the pools: its prompt, or what it decoded before
        for seq_id, n, table in zip(rows, lens, tables, strict=True):
            history = 3 if seq_id == "chunk" else n - 1
            if seq_id == "chunk" or seq_id not in cache.slab.slot_of:
                slots = torch.tensor(
                    [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(history)], dtype=torch.long
                )
                k = torch.randn(history, KV_HEADS, DIM, generator=g).to(dtype)
                cache.write(0, k, torch.randn(history, KV_HEADS, DIM, generator=g).to(dtype), slots)
        step = Ragged.build(queries, lens, tables, BLOCK, seq_ids=rows)
        plain = Ragged.build(queries, lens, tables, BLOCK)
        before = cache.slab.capacity
        at = cache.prepare(step)
        key, value = written(cache, step, g, dtype)
        query = torch.randn(step.num_tokens, HEADS, DIM, generator=g).to(dtype)
        expected = ragged_attention(query, cache.keys[0], cache.values[0], plain, layer)
        if at is None:
            seen["pools"] += 1
            assert len(step.decode_ids) < WIDE_MIN_ROWS
            continue
        seen["slab"] += 1
        seen["unordered"] += not at.ordered
        seen["grown"] += before != (0, 0) and larger(cache.slab.capacity, before)
        seen["anew"] += before != (0, 0) and larger(before, cache.slab.capacity)
        shapes.add(cache.slab.capacity)
        decodes = step.decodes
        cache.slab.write(0, key[decodes], value[decodes], at)
        got = ragged_attention(
            query, cache.keys[0], cache.values[0], step, layer, (*cache.slab.view(0, at), at)
        )
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance, msg=f"step {step_no}")
        if chunk:
            free += tables[-1]
    assert all(seen.values()), seen  # every path of the slab ran
    assert len(shapes) >= 3


def test_the_slab_is_let_go_when_no_row_decodes() -> None:
    cache = PagedCache([0], num_blocks=16, block_size=BLOCK, kv_heads=KV_HEADS, head_dim=DIM)
    ids = [f"s{i}" for i in range(WIDE_MIN_ROWS)]
    tables = [[i] for i in range(WIDE_MIN_ROWS)]
    assert cache.prepare(Ragged.build([1] * len(ids), [2] * len(ids), tables, BLOCK, seq_ids=ids)) is not None
    assert cache.slab.nbytes() > 0
    assert cache.prepare(Ragged.build([3], [3], [[9]], BLOCK, seq_ids=["p"])) is None
    assert cache.slab.nbytes() == 0 and not cache.slab.slot_of
