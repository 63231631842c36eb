"""The paged KV cache and ragged attention (`app.partitions.paged`) against dense attention over the
same keys and values: SDPA where it can express the layer, an fp64 softmax where it cannot
(soft-capping). Mixed decode rows and prefill chunks, grouped-query heads, sliding windows, block
boundaries, tables in scattered blocks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from app.partitions import paged
from app.partitions.paged import LayerAttention, PagedCache, Ragged, ragged_attention
from app.workers.engine.scheduler import Scheduler, SchedulerConfig, Seq
from tests.families import CONFIGS

BLOCK = 4
# (queries, positions once written): a decode row, a one-token prompt, a whole prompt, a chunk after
# cached positions, a decode row at a block's last offset, a chunk ending a block, a decode row
# starting a block
MIXED = [(1, 7), (1, 1), (5, 5), (3, 10), (1, 8), (4, 8), (1, 9)]


def batch(shape: list[tuple[int, int]], *, heads: int, kv_heads: int, dtype: torch.dtype = torch.float32):  # type: ignore[no-untyped-def]
    """A cache holding every sequence's keys and values in scattered blocks, its step's queries, and
    the dense per-sequence keys and values [n, kv heads, D] they came from."""
    g = torch.Generator().manual_seed(len(shape) * 100 + heads)
    dim = 16
    blocks = torch.randperm(64, generator=g).tolist()
    cache = PagedCache([0], num_blocks=64, block_size=BLOCK, kv_heads=kv_heads, head_dim=dim, dtype=dtype)
    tables, dense = [], []
    for _, n in shape:
        table = [blocks.pop() for _ in range(-(-n // BLOCK))]
        k = torch.randn(n, kv_heads, dim, generator=g).to(dtype)
        v = torch.randn(n, kv_heads, dim, generator=g).to(dtype)
        slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)])
        cache.write(0, k, v, slots)
        tables.append(table)
        dense.append((k, v))
    step = Ragged.build([q for q, _ in shape], [n for _, n in shape], tables, BLOCK)
    query = torch.randn(step.num_tokens, heads, dim, generator=g).to(dtype)
    return cache, step, query, dense


def dense_reference(query, dense, shape, layer: LayerAttention, *, heads: int):  # type: ignore[no-untyped-def]
    """Each sequence on its own, over its whole keys: SDPA, or an fp64 softmax with soft-capping."""
    outs, start = [], 0
    for (q, n), (k, v) in zip(shape, dense, strict=True):
        queries = query[start : start + q].transpose(0, 1)[None]  # [1, H, S, D]
        group = heads // k.shape[1]
        keys = k.transpose(0, 1).repeat_interleave(group, 0)[None]  # [1, H, n, D]
        values = v.transpose(0, 1).repeat_interleave(group, 0)[None]
        at = torch.arange(n - q, n)[:, None]
        column = torch.arange(n)[None, :]
        allowed = column <= at
        if layer.window is not None:
            allowed &= column > at - layer.window
        if layer.softcap is None:
            out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=allowed, scale=layer.scale)
        else:
            scores = queries.double() @ keys.double().transpose(-1, -2) * layer.scale
            scores = torch.tanh(scores / layer.softcap) * layer.softcap
            weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1)
            out = (weights @ values.double()).to(query.dtype)
        outs.append(out[0].transpose(0, 1))
        start += q
    return torch.cat(outs)


@pytest.mark.parametrize("by_head", [False, True], ids=["one-gather", "gather-by-head"])
@pytest.mark.parametrize(("heads", "kv_heads"), [(6, 2), (4, 4), (3, 1)])
def test_a_mixed_step_equals_dense_attention(heads: int, kv_heads: int, by_head: bool, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    if by_head:  # a large step's gather, whatever this one's size
        monkeypatch.setattr(paged, "GATHER_BY_HEAD_BYTES", 0)
    cache, step, query, dense = batch(MIXED, heads=heads, kv_heads=kv_heads)
    layer = LayerAttention(scale=16**-0.5)
    out = ragged_attention(query, cache.keys[0], cache.values[0], step, layer)
    torch.testing.assert_close(
        out, dense_reference(query, dense, MIXED, layer, heads=heads), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("window", [1, 3, 4, 6])
def test_a_sliding_window_sees_only_its_last_keys(window: int) -> None:
    cache, step, query, dense = batch(MIXED, heads=6, kv_heads=2)
    layer = LayerAttention(scale=0.3, window=window)
    out = ragged_attention(query, cache.keys[0], cache.values[0], step, layer)
    torch.testing.assert_close(
        out, dense_reference(query, dense, MIXED, layer, heads=6), atol=1e-5, rtol=1e-5
    )


def test_soft_capped_logits_match_an_exact_softmax() -> None:
    cache, step, query, dense = batch(MIXED, heads=6, kv_heads=2)
    layer = LayerAttention(scale=2.0, window=5, softcap=3.0)  # large scores: the cap matters
    out = ragged_attention(query, cache.keys[0], cache.values[0], step, layer)
    reference = dense_reference(query, dense, MIXED, layer, heads=6)
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)
    uncapped = ragged_attention(query, cache.keys[0], cache.values[0], step, LayerAttention(2.0, 5))
    assert (uncapped - reference).abs().max() > 0.1


# MIXED's four decode rows take the matrix products in half precision; the three rows of
# MIXED[:3] (one of them a prompt), SDPA.
@pytest.mark.parametrize("shape", [MIXED, MIXED[:3]], ids=["products", "sdpa"])
@pytest.mark.parametrize("window", [None, 3])
def test_in_bfloat16_a_step_stays_close_to_dense_attention(
    shape: list[tuple[int, int]], window: int | None
) -> None:
    cache, step, query, dense = batch(shape, heads=6, kv_heads=2, dtype=torch.bfloat16)
    layer = LayerAttention(scale=0.25, window=window)
    out = ragged_attention(query, cache.keys[0], cache.values[0], step, layer)
    assert out.dtype == torch.bfloat16
    reference = dense_reference(
        query.float(), [(k.float(), v.float()) for k, v in dense], shape, layer, heads=6
    )
    torch.testing.assert_close(out.float(), reference, atol=3e-2, rtol=3e-2)


def test_only_decode_rows_or_only_chunks() -> None:
    for shape in ([(1, 5), (1, 12), (1, 4)], [(6, 6), (2, 9)]):
        cache, step, query, dense = batch(shape, heads=6, kv_heads=2)
        layer = LayerAttention(scale=0.25)
        out = ragged_attention(query, cache.keys[0], cache.values[0], step, layer)
        torch.testing.assert_close(
            out, dense_reference(query, dense, shape, layer, heads=6), atol=1e-5, rtol=1e-5
        )


def test_write_puts_each_token_at_its_slot() -> None:
    cache = PagedCache([3, 4], num_blocks=8, block_size=4, kv_heads=2, head_dim=2)
    key = torch.arange(12.0).reshape(3, 2, 2)
    cache.write(4, key, -key, torch.tensor([5, 6, 28]))  # block 1 offsets 1, 2; block 7 offset 0
    assert torch.equal(cache.keys[4][:, 1, 1], key[0]) and torch.equal(cache.keys[4][:, 7, 0], key[2])
    assert torch.equal(cache.values[4][:, 1, 2], -key[1])
    assert not cache.keys[3].any() and cache.nbytes() == 4 * 8 * 2 * 4 * 2 * 4


def test_a_step_that_does_not_fit_its_tables_is_refused() -> None:
    with pytest.raises(ValueError, match="in 2 blocks"):
        Ragged.build([1], [9], [[0, 1]], 4)
    with pytest.raises(ValueError, match="one query length"):
        Ragged.build([1, 1], [2], [[0]], 4)


def test_the_scheduler_plans_slots_the_cache_agrees_with() -> None:
    s = Scheduler(SchedulerConfig(num_blocks=16, block_size=BLOCK, max_num_seqs=4, max_num_batched_tokens=12))
    s.add(Seq("a", tuple(range(9)), 4))
    s.add(Seq("b", tuple(range(100, 106)), 4))
    plan = s.schedule()
    s.update(plan, {r.seq_id: 1 for r in plan.rows if r.samples})
    plan = s.schedule()  # a decodes, b's chunk after its first 3 ids
    rows = plan.rows
    step = Ragged.build([len(r.tokens) for r in rows], [r.stop for r in rows], [r.table for r in rows], BLOCK)
    assert step.slots.tolist() == [slot for r in rows for slot in r.slots(BLOCK)]
    assert [len(r.tokens) for r in rows] == [1, 3]


@pytest.mark.parametrize("family", ["llama", "gemma2", "gemma3", "granite", "qwen2-window"])
def test_a_layers_attention_is_the_one_transformers_builds(family: str) -> None:
    config = CONFIGS[family]
    model = AutoModelForCausalLM.from_config(config)
    for index, layer in enumerate(model.model.layers):
        module = layer.self_attn
        expected = LayerAttention(
            module.scaling,
            getattr(module, "sliding_window", None),
            getattr(module, "attn_logit_softcapping", None),
        )
        assert LayerAttention.of(config, index) == expected
        assert LayerAttention.of(config, index, module) == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_pool_takes_memory_only_for_the_blocks_written(dtype: torch.dtype) -> None:
    """A CPU pool of 1 GiB costs no resident memory at its start and reads zeros wherever nothing
    was written: a worker's KV cache holds what its sequences used, not its whole size."""
    import psutil

    me = psutil.Process()
    before = me.memory_info().rss
    num_blocks = 2**30 // (2 * 2 * 2 * 16 * 64 * dtype.itemsize)  # 2 layers, keys and values, 2 heads: 1 GiB
    cache = PagedCache([0, 1], num_blocks=num_blocks, block_size=16, kv_heads=2, head_dim=64, dtype=dtype)
    assert me.memory_info().rss - before < 2**27  # under 128 MiB of the 1 GiB
    k = torch.randn(3, 2, 64).to(dtype)
    cache.write(1, k, 2 * k, torch.tensor([5, 16 * 700, 16 * num_blocks - 1]))
    assert me.memory_info().rss - before < 2**27
    keys, values = cache.keys[1], cache.values[1]
    assert torch.equal(keys[:, 0, 5], k[0]) and torch.equal(values[:, -1, -1], 2 * k[2])
    assert torch.count_nonzero(keys) == torch.count_nonzero(k) and not cache.keys[0].any()
