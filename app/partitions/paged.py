"""A paged KV cache for one stage's layers, and attention over it for a ragged step.

The cache is, per layer, a key pool and a value pool of `num_blocks` blocks of `block_size`
positions, [kv heads, num blocks, block size, head dim] (heads first: gathering a row's blocks
then gives each head's keys as one contiguous matrix, which a CPU's batched matrix product needs;
with blocks first the gather needs a second copy, and was 1.5-7x slower in SmolLM2's shapes); a
sequence's positions live in the blocks of its block table (position p in block
`table[p // block_size]` at offset `p % block_size`), chosen by the step scheduler
(`app.workers.engine`), the same tables on every stage. Nothing moves when a sequence joins, ends
or is preempted: its blocks are only reassigned.

A ragged step is a flat batch of T query tokens: decode rows (one token over its history) and
prefill chunks (a sequence's next tokens, causal among themselves, after what it has cached), each
sequence at its own length. `Ragged` describes one step for every layer (query spans, context
lengths, block tables, where each new token's key goes); each layer writes its new keys and values
(`PagedCache.write`) then attends (`ragged_attention`):

- the decode rows together: each row's blocks gathered into [kv heads, rows, blocks x block_size,
  head dim], the query heads of a KV head packed as that head's queries (`app.partitions.attention`
  says why), the positions past each row's length masked; one attention call. From `SLAB_MIN_ROWS`
  rows on, when the step names their sequences (the engine loop's steps do), they read the cache's
  slab instead (`app.partitions.slab`: the decoding sequences' keys and values kept contiguous
  between steps), which saves the gather, a copy of every row's history in every layer;
- each prefill chunk on its own: its blocks gathered, a causal mask offset by what it had cached.

Grouped-query heads, sliding windows (a query at position q sees keys in (q - window, q], the
stages' rule) and Gemma 2's attention-logit soft-capping are handled; the scale is the layer's
(`LayerAttention.of`). Scores are accumulated in fp32 whatever the cache's dtype (SDPA's CPU
kernel does); decode rows in half precision, from `WIDE_MIN_ROWS` rows on, and soft-capped layers
take two matrix products instead, the softmax in fp32, as the batch engine's decode steps do.
torch 2.13's own ragged options lose on a CPU: variable-length attention
(`torch.nn.attention.varlen`) has no CPU kernel, and compiled flex attention with a block mask and
SDPA over nested tensors were 10-100x slower than this (docs/architecture.md, "The step engine").
Against the stages' decode path today: bench/results/paged_attention.md.

The step engine's worker (`CONVEYOR_ENGINE=step`) runs on it through `app.partitions.ragged`; the
batch engine's batches run over `app.partitions.kvcache`.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from app.partitions.attention import HALF, WIDE_MIN_ROWS
from app.partitions.families import SLIDING, attention_kinds
from app.partitions.slab import Slab, SlabStep


@dataclass(frozen=True)
class LayerAttention:
    """What one layer's attention needs besides its tensors."""

    scale: float
    window: int | None = None  # sliding-window size; None: the whole history
    softcap: float | None = None  # attention-logit soft-capping (Gemma 2)

    @classmethod
    def of(cls, config: Any, layer: int, module: torch.nn.Module | None = None) -> LayerAttention:
        """Layer `layer` of a model of `config`; the scale is the attention module's own `scaling`
        when given (transformers sets it per family), else the config's (Gemma's
        `query_pre_attn_scalar`, Granite's `attention_multiplier`) or 1/sqrt(head dim)."""
        scale = getattr(module, "scaling", None)
        if scale is None:
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            if getattr(config, "attention_multiplier", None) is not None:
                scale = config.attention_multiplier
            elif getattr(config, "query_pre_attn_scalar", None) is not None:
                scale = config.query_pre_attn_scalar**-0.5
            else:
                scale = head_dim**-0.5
        window = config.sliding_window if attention_kinds(config)[layer] == SLIDING else None
        return cls(float(scale), window, getattr(config, "attn_logit_softcapping", None))


# From this many decode rows on, a step's decode rows read the slab (`app.partitions.slab`), not their
# blocks: whole decode steps of SmolLM2 in bf16 on two threads, interleaved with the batch engine's,
# went from 0.85-0.93x of its speed to 0.96-0.97x at 16 rows and from 0.86-0.88x to 0.95-0.99x at 64
# (bench/results/slab.md). At one row the slab measured slower than the row's small gather (0.81x).
SLAB_MIN_ROWS = WIDE_MIN_ROWS


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A tensor of zeros whose memory, on a CPU, is taken as it is written: the pages of an anonymous
    mapping read as zeros until then, so a pool of gigabytes costs nothing to allocate and holds only
    the blocks used so far (torch.zeros writes every byte first: 1.9 s and 2.8 GiB resident for
    SmolLM2's fp32 pool at the worker's start). Elsewhere, torch's zeros."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    size = math.prod(shape) * dtype.itemsize
    if size == 0:
        return torch.zeros(shape, dtype=dtype)
    # the tensor keeps the mapping alive (torch.frombuffer holds a reference to it)
    return torch.frombuffer(mmap.mmap(-1, size), dtype=dtype).view(shape)


class PagedCache:
    """Key and value block pools of the layers `layers` (global indices), on one device."""

    def __init__(
        self,
        layers: Sequence[int],
        *,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.block_size = block_size
        shape = (kv_heads, num_blocks, block_size, head_dim)
        # zeros, not empty: a masked position still multiplies its value by a zero weight, and an
        # uninitialised NaN there would poison the row
        self.keys = {i: zeros(shape, dtype, device) for i in layers}
        self.values = {i: zeros(shape, dtype, device) for i in layers}
        # the decoding sequences' keys and values again, contiguous (`app.partitions.slab`): one slab
        # per micro-batch of a pipeline (a plan's `group`), each holding the same sequences step after
        # step; `slab` is the one of the step being run
        self._slab = (tuple(layers), kv_heads, head_dim, dtype, device)
        self.slabs = {0: self._new_slab()}
        self.slab = self.slabs[0]

    def _new_slab(self) -> Slab:
        layers, kv_heads, head_dim, dtype, device = self._slab
        return Slab(layers, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, device=device)

    def reset_slabs(self) -> None:
        for slab in self.slabs.values():
            slab.reset()

    def prepare(self, step: Ragged, group: int = 0) -> SlabStep | None:
        """The slab of micro-batch `group` brought to a step's decode rows, when the step names their
        sequences and has at least `SLAB_MIN_ROWS` of them (fewer: each row's gather is small, and the
        slab is let go)."""
        if group not in self.slabs:
            self.slabs[group] = self._new_slab()
        self.slab = self.slabs[group]
        if len(step.decode_ids) < SLAB_MIN_ROWS:
            self.slab.reset()
            return None
        rows = [i for i, q in enumerate(step.query_lens) if q == 1]
        return self.slab.prepare(
            step.decode_ids,
            [step.context_lens[i] for i in rows],
            [step.tables[i] for i in rows],
            (self.keys, self.values),
            self.block_size,
        )

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self.keys.values(), *self.values.values()])

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        """Store a step's new keys/values [T, kv heads, head dim] at `slots` [T] (block * size + offset):
        one `index_copy_` per pool along its positions, the pool seen as [kv heads, blocks x size, dim]."""
        for pool, new in ((self.keys[layer], key), (self.values[layer], value)):
            kv_heads, _, _, dim = pool.shape
            pool.view(kv_heads, -1, dim).index_copy_(1, slots, new.transpose(0, 1).to(pool.dtype))


@dataclass(frozen=True)
class Ragged:
    """One ragged step's layout, built once and shared by every layer: sequence i has queries
    [starts[i], starts[i] + query_lens[i]) of the flat batch, at positions [context_lens[i] -
    query_lens[i], context_lens[i]) of its history, whose blocks are `tables[i]`."""

    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]  # its positions once this step's are written
    tables: tuple[tuple[int, ...], ...]
    block_size: int
    slots: torch.Tensor  # [T] long: where each query token's key and value go
    decodes: torch.Tensor  # [B] long: the flat index of each one-token row's query
    decode_blocks: torch.Tensor  # [B * max blocks] long: their tables, padded with block 0
    decode_positions: torch.Tensor  # [B] long: each one-token row's query position
    decode_ids: tuple[str, ...] = ()  # the one-token rows' sequences, when the caller names them (the slab's)
    # what every layer of the step would build again: masks by (rows' kind, width, window), blocks
    _shared: dict[tuple[Any, ...], torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        seq_ids: Sequence[str] = (),
    ) -> Ragged:
        """`seq_ids`, one per row when given, lets the decode rows read the cache's slab."""
        if not len(query_lens) == len(context_lens) == len(tables):
            raise ValueError("one query length, context length and block table per sequence")
        if seq_ids and len(seq_ids) != len(query_lens):
            raise ValueError("one sequence id per row")
        slots: list[int] = []
        for q, n, table in zip(query_lens, context_lens, tables, strict=True):
            if not 0 < q <= n or len(table) * block_size < n:
                raise ValueError(f"a sequence of {n} positions, {q} of them queries, in {len(table)} blocks")
            slots += [table[p // block_size] * block_size + p % block_size for p in range(n - q, n)]
        rows = [i for i, q in enumerate(query_lens) if q == 1]
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        width = max((len(tables[i]) for i in rows), default=0)
        padded = [list(tables[i]) + [0] * (width - len(tables[i])) for i in rows]

        def tensor(values: Sequence[int] | list[list[int]]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        return cls(
            tuple(query_lens),
            tuple(context_lens),
            tuple(tuple(t) for t in tables),
            block_size,
            tensor(slots),
            tensor([starts[i] for i in rows]),
            tensor(padded).reshape(len(rows) * width),
            tensor([context_lens[i] - 1 for i in rows]),
            tuple(seq_ids[i] for i in rows) if seq_ids else (),
        )

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    def decode_allowed(self, width: int, window: int | None) -> torch.Tensor:
        """[1, B, 1, width]: which of the `width` gathered positions each decode row's query sees
        (built once a step for each window, not once a layer)."""
        key = ("decode", width, window)
        if key not in self._shared:
            column = torch.arange(width, device=self.decode_positions.device)  # [L]
            at = self.decode_positions[:, None]  # [B, 1]
            allowed = column <= at  # [B, L]
            if window is not None:
                allowed &= column > at - window
            self._shared[key] = allowed[None, :, None, :]
        return self._shared[key]

    def chunk_blocks(self, row: int, device: torch.device) -> torch.Tensor:
        """The blocks holding prefill row `row`'s history, as a tensor (once a step)."""
        key = ("blocks", row)
        if key not in self._shared:
            n = -(-self.context_lens[row] // self.block_size)
            self._shared[key] = torch.tensor(self.tables[row][:n], dtype=torch.long, device=device)
        return self._shared[key]

    def chunk_allowed(self, row: int, window: int | None, group: int, device: torch.device) -> torch.Tensor:
        """[1, 1, group x S, N]: which of its N positions each of prefill row `row`'s S queries sees,
        repeated for the `group` query heads of a KV head (once a step for each window)."""
        key = ("chunk", row, window, group)
        if key not in self._shared:
            new, length = self.query_lens[row], self.context_lens[row]
            at = torch.arange(length - new, length, device=device)[:, None]  # [S, 1]
            column = torch.arange(length, device=device)[None, :]  # [1, N]
            allowed = column <= at  # [S, N]
            if window is not None:
                allowed &= column > at - window
            self._shared[key] = allowed.repeat(group, 1)[None, None]
        return self._shared[key]


def ragged_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    step: Ragged,
    layer: LayerAttention,
    slab: tuple[torch.Tensor, torch.Tensor, SlabStep] | None = None,
) -> torch.Tensor:
    """Attention of a ragged step's queries [T, heads, head dim] over a layer's block pools
    [kv heads, num blocks, block size, head dim] (this step's keys already written): [T, heads, dim].
    The decode rows read the layer's slab instead when it is given (its keys, values and the step's
    view of it)."""

    def decode(rows: torch.Tensor) -> torch.Tensor:
        if slab is not None:
            return _decode_slab(rows, *slab, layer)
        return _decode_rows(rows, keys, values, step, layer)

    if len(step.decodes) == len(query):  # decode rows only: no scatter
        return decode(query)
    out = torch.empty_like(query)
    if len(step.decodes):
        out[step.decodes] = decode(query[step.decodes])
    start = 0
    for row, q in enumerate(step.query_lens):
        if q > 1:
            out[start : start + q] = _chunk(query[start : start + q], keys, values, step, row, layer)
        start += q
    return out


def _decode_rows(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, step: Ragged, layer: LayerAttention
) -> torch.Tensor:
    """query [B, H, D], one per row, at `step.decode_positions` -> [B, H, D]."""
    rows, heads, dim = query.shape
    kv_heads = keys.shape[0]
    k = _gather(keys, step.decode_blocks, rows)  # [Hkv, B, L, D]
    v = _gather(values, step.decode_blocks, rows)
    allowed = step.decode_allowed(k.shape[2], layer.window)  # [1, B, 1, L]
    packed = query.reshape(rows, kv_heads, heads // kv_heads, dim).transpose(0, 1)  # [Hkv, B, G, D]
    # Half precision from WIDE_MIN_ROWS rows on: two products, as the batch engine's decode steps
    # (`app.partitions.attention`); SDPA's CPU kernel is slower there (bf16, SmolLM2's heads, 208
    # keys, the call alone: 0.36 against 0.60-0.91 ms at 32 rows, 0.59-0.85 against 1.27-1.60 ms at
    # 64; whole decode steps of SmolLM2 on two threads, interleaved: 1.04x faster at 16 rows, 1.16x
    # at 32, 1.12x at 64).
    products = query.dtype in HALF and rows >= WIDE_MIN_ROWS
    out = _attend(packed, k, v, allowed, layer, products=products)  # [Hkv, B, G, D]
    return out.transpose(0, 1).reshape(rows, heads, dim)


def _decode_slab(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, at: SlabStep, layer: LayerAttention
) -> torch.Tensor:
    """query [B, H, D], one per row, over the slab's keys and values [Hkv, slots, L, D] -> [B, H, D];
    the queries are put in slot order (a free slot gets a zero query, its output unread)."""
    rows, heads, dim = query.shape
    kv_heads, used = keys.shape[0], at.used
    q = query if at.ordered else query.new_zeros(used, heads, dim).index_copy_(0, at.slots, query)
    packed = q.reshape(used, kv_heads, heads // kv_heads, dim).transpose(0, 1)  # [Hkv, S, G, D]
    products = query.dtype in HALF and rows >= WIDE_MIN_ROWS  # as `_decode_rows`
    out = _attend(packed, keys, values, at.allowed(layer.window), layer, products=products)
    out = out.transpose(0, 1).reshape(used, heads, dim)
    return out if at.ordered else out.index_select(0, at.slots)


def _chunk(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    step: Ragged,
    row: int,
    layer: LayerAttention,
) -> torch.Tensor:
    """Prefill row `row`'s S queries [S, H, D], the last S of its N positions -> [S, H, D]."""
    new, heads, dim = query.shape
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    length = step.context_lens[row]
    blocks = step.chunk_blocks(row, query.device)
    k = _gather(keys, blocks, 1).transpose(0, 1)[:, :, :length]  # [1, Hkv, N, D]
    v = _gather(values, blocks, 1).transpose(0, 1)[:, :, :length]
    allowed = step.chunk_allowed(row, layer.window, group, query.device)  # [1, 1, G * S, N]
    # [S, H, D] -> [1, Hkv, G * S, D]: a KV head's queries, query head by query head
    packed = (
        query.reshape(new, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(1, kv_heads, group * new, dim)
    )
    out = _attend(packed, k, v, allowed, layer)  # [1, Hkv, G * S, D]
    return out.reshape(kv_heads, group, new, dim).permute(2, 0, 1, 3).reshape(new, heads, dim)


# From this many gathered bytes on, a gather copies head by head along the blocks' own dimension
# (PyTorch's CPU kernel copies whole blocks there), not in one `index_select` over dimension 1.
# Whole decode steps of SmolLM2 in bf16 on two threads, interleaved, one `index_select` against by
# head: 28.5 against 29.2 ms at one row (55 KiB; three calls' overhead), level at 4-8 rows, 1.04-1.08x
# faster at 32 rows and 1.06-1.26x at 64 (bench/results/paged-gather.md).
GATHER_BY_HEAD_BYTES = 512 * 2**10


def _gather(pool: torch.Tensor, blocks: torch.Tensor, rows: int) -> torch.Tensor:
    """pool [Hkv, NB, bs, D], blocks [rows * n] (row by row) -> [Hkv, rows, n * bs, D], one copy."""
    kv_heads, _, size, dim = pool.shape
    if len(blocks) * size * dim * kv_heads * pool.element_size() < GATHER_BY_HEAD_BYTES:
        return pool.index_select(1, blocks).view(kv_heads, rows, -1, dim)
    out = torch.empty((kv_heads, len(blocks), size, dim), dtype=pool.dtype, device=pool.device)
    for head in range(kv_heads):
        torch.index_select(pool[head], 0, blocks, out=out[head])
    return out.view(kv_heads, rows, -1, dim)


def _attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    allowed: torch.Tensor,
    layer: LayerAttention,
    *,
    products: bool = False,
) -> torch.Tensor:
    """softmax(cap(q k^T * scale) | allowed) v over [X, Y, M, D] queries and [X, Y, N, D] keys and
    values, the scores in fp32; `allowed` broadcasts to [X, Y, M, N] and allows every query a key.
    Without soft-capping, and unless `products` asks for the matrix products, PyTorch's fused SDPA
    kernel does it (it accumulates in fp32 too)."""
    if layer.softcap is None and not products:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=layer.scale)
    scores = torch.matmul(query, key.transpose(-1, -2)).float().mul_(layer.scale)  # [B, Hkv, M, N]
    if layer.softcap is not None:
        scores = torch.tanh(scores.div_(layer.softcap)).mul_(layer.softcap)
    scores.masked_fill_(~allowed, float("-inf"))
    weights = torch.softmax(scores, dim=-1).to(value.dtype)
    return torch.matmul(weights, value)
