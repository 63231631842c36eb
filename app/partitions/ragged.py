"""A ragged step over one stage's layers: a flat batch of tokens, each sequence at its own positions,
keys and values in a paged cache (`app.partitions.paged`).

The step scheduler (`app.workers.engine.scheduler`) plans a step as rows: a decode row (a running
sequence's one next token) or a prefill chunk (a sequence's next prompt tokens, after what it has
cached). `forward` runs such a step through a stage's own modules, transformers' decoder layers,
with no padding: the step's T tokens are one sequence of T to them ([1, T, D], each token's own
position id), and two seams make it ragged:

- the cache the layers are given (`_StepCache`) writes each layer's new keys and values into the
  paged pools at the step's slots and hands the pools back as "the keys and values";
- the attention they dispatch to (`IMPLEMENTATION`, registered with transformers' attention
  interface and selected for the step) reads the pools through the step's layout
  (`paged.ragged_attention`), each row over its own history only.

Everything else a layer does (norms, rotary embeddings at the given positions, MLPs, experts,
residual multipliers, soft-capping) is per token, so it runs as it does in `generate`. The stage's
embedding and head are the family's own (`StagePartition._embed`, `finish`). Every stage of a
pipeline runs the same step layout on its own cache; the last returns the next-token logits of the
rows that sample.

A family whose rotary tables depend on a sequence's length (dynamic NTK, longrope) is refused here:
its tables are per row (`app.partitions.rope`), and a flat step has one position table.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import AttentionInterface

from app.core.errors import UnsupportedModel
from app.partitions.layers import StagePartition
from app.partitions.paged import LayerAttention, PagedCache, Ragged, ragged_attention
from app.partitions.slab import SlabStep

IMPLEMENTATION = "conveyor_ragged"


class StepLayout:
    """One step's layout, each layer's attention rules and the cache's slab for the step: what the
    layers receive as their attention mask, read back by `_attention` (transformers hands the mask
    through unchanged)."""

    def __init__(
        self, step: Ragged, layers: dict[int, LayerAttention], cache: PagedCache, slab: SlabStep | None
    ) -> None:
        self.step = step
        self.layers = layers
        self.cache = cache
        self.slab = slab


class _StepCache:
    """The cache a layer sees during a ragged step: new keys/values go to the paged pools (and the
    decode rows' to the slab)."""

    def __init__(self, cache: PagedCache, step: Ragged, slab: SlabStep | None) -> None:
        self.cache = cache
        self.step = step
        self.slab = slab

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """key/value [1, kv heads, T, D] -> this layer's pools [kv heads, blocks, block size, D]."""
        key, value = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, kv heads, D]
        self.cache.write(layer_idx, key, value, self.step.slots)
        if self.slab is not None:
            if len(self.step.decodes) != len(key):
                key, value = key[self.step.decodes], value[self.step.decodes]
            self.cache.slab.write(layer_idx, key, value, self.slab)
        return self.cache.keys[layer_idx], self.cache.values[layer_idx]


def _attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """query [1, heads, T, D] over the pools `key`/`value`: [1, T, heads, D], as transformers'
    attention functions return it."""
    if not isinstance(attention_mask, StepLayout):
        raise RuntimeError("ragged attention runs only inside a ragged step (`forward`)")
    layer: int = module.layer_idx  # type: ignore[assignment]
    at = attention_mask.slab
    slab = None if at is None else (*attention_mask.cache.slab.view(layer, at), at)
    out = ragged_attention(
        query[0].transpose(0, 1), key, value, attention_mask.step, attention_mask.layers[layer], slab
    )
    return out[None], None


def check(stage: StagePartition) -> None:
    """Refuse a stage that ragged steps cannot run exactly."""
    if stage.rope is not None:
        raise UnsupportedModel(
            "rotary tables that depend on a sequence's length (dynamic NTK or longrope) are per row; "
            "the step engine runs one position table per step"
        )


def cache_for(
    stage: StagePartition, num_blocks: int, block_size: int, dtype: torch.dtype | None = None
) -> PagedCache:
    """A paged cache for `stage`'s layers, `num_blocks` blocks of `block_size` positions each."""
    config = stage.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return PagedCache(
        range(stage.range.start, stage.range.stop),
        num_blocks=num_blocks,
        block_size=block_size,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype or stage.dtype,
        device=stage.device,
    )


def layer_rules(stage: StagePartition) -> dict[int, LayerAttention]:
    """Each of the stage's layers' attention rules (scale, window, soft-cap), by global index."""
    rules = {}
    for index, layer in enumerate(stage.layers):
        attn = getattr(layer, "self_attn", None) or getattr(layer, "attn", None)
        rules[stage.range.start + index] = LayerAttention.of(stage.config, stage.range.start + index, attn)
    return rules


@torch.inference_mode()
def forward(
    stage: StagePartition,
    cache: PagedCache,
    step: Ragged,
    x: torch.Tensor,
    *,
    rules: dict[int, LayerAttention] | None = None,
    sample: Sequence[int] = (),
    final: list[torch.Tensor] | None = None,
    group: int = 0,
) -> torch.Tensor:
    """Run a ragged step over `stage`'s layers (of micro-batch `group`: the decode slab it reads).

    x: the step's token ids [T] on the first stage, hidden states [T, D] on the others.
    Returns hidden states [T, D]; on the last stage, the float32 next-token logits [R, V] of the
    flat indices `sample` (each sampling row's last token), in that order, and the final hidden
    states [T, D] (before the norm) are appended to `final` when it is given (echo's logprobs)."""
    if IMPLEMENTATION not in AttentionInterface._global_mapping:
        AttentionInterface.register(IMPLEMENTATION, _attention)
    device = stage.device
    positions: list[int] = []
    for q, n in zip(step.query_lens, step.context_lens, strict=True):
        positions += range(n - q, n)
    position_ids = torch.tensor([positions], dtype=torch.long, device=device)  # [1, T]
    x = x.to(device)
    hidden = stage._embed(x[None], position_ids) if stage.embed_tokens is not None else x[None]
    rotary = stage._rotary(hidden, position_ids)
    slab = cache.prepare(step, group)
    layout = StepLayout(step, rules if rules is not None else layer_rules(stage), cache, slab)
    paged = _StepCache(cache, step, slab)
    config = stage.config
    chosen = config._attn_implementation
    config._attn_implementation = IMPLEMENTATION
    try:
        for layer, kind in zip(stage.layers, stage.kinds, strict=True):
            extra = {} if rotary is None else {"position_embeddings": rotary[kind]}
            out = layer(
                hidden, attention_mask=layout, position_ids=position_ids, cache=paged, use_cache=True, **extra
            )
            hidden = out[0] if isinstance(out, tuple) else out
    finally:
        config._attn_implementation = chosen
    hidden = hidden[0]  # [T, D]
    if stage.lm_head is None or stage.norm is None:
        return hidden
    if final is not None:
        final.append(hidden)
    rows = hidden[torch.tensor(list(sample), dtype=torch.long, device=device)]
    logits = stage.lm_head(stage.norm(rows))
    return stage.family.logits(config, logits).float()  # type: ignore[no-any-return]
