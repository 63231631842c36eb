"""A decoder language model cut on layer boundaries: one stage runs layers [start, stop).

The first stage owns the token embedding, the last one the final norm and the LM head; a model
that fits one device is the one-stage case of the same code. Per batch, a stage keeps its own
KV cache and attention mask (`BatchState`); positions are derived from the mask, never counted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer
from transformers.masking_utils import create_causal_mask

from app.partitions.kvcache import SlabLayer
from app.partitions.loading import build_on_meta, materialize


@dataclass(frozen=True)
class LayerRange:
    start: int
    stop: int  # exclusive

    @classmethod
    def even_split(cls, num_layers: int, stages: int, stage: int) -> LayerRange:
        if not 0 <= stage < stages <= num_layers:
            raise ValueError(f"cannot cut {num_layers} layers into {stages} stages (stage {stage})")
        bounds = [round(i * num_layers / stages) for i in range(stages + 1)]
        return cls(bounds[stage], bounds[stage + 1])


class BatchState:
    """What one stage remembers about one batch between steps."""

    def __init__(self, config: PretrainedConfig, seq_ids: list[str], attention_mask: torch.Tensor) -> None:
        self.cache = DynamicCache(config=config)
        kinds = {type(layer) for layer in self.cache.layers}
        if kinds - {DynamicLayer}:
            raise ValueError(
                f"only full-attention layers are supported, not {sorted(k.__name__ for k in kinds)}"
            )
        self.cache.layers = [SlabLayer() for _ in self.cache.layers]
        self.seq_ids = list(seq_ids)
        self.attention_mask = attention_mask  # [B, T] 1 = real token, 0 = left padding

    @property
    def slabs(self) -> list[SlabLayer]:
        return self.cache.layers  # type: ignore[return-value]

    def keep(self, seq_ids: list[str]) -> None:
        """Drop the rows of sequences that have finished (the TGI `filter` rule)."""
        if seq_ids == self.seq_ids:
            return
        position = {seq_id: row for row, seq_id in enumerate(self.seq_ids)}
        missing = [s for s in seq_ids if s not in position]
        if missing:
            raise KeyError(f"sequences not in this batch: {missing}")
        rows = [position[s] for s in seq_ids]
        for layer in self.slabs:
            layer.select(rows)
        self.attention_mask = self.attention_mask[torch.tensor(rows, dtype=torch.long)]
        self.seq_ids = list(seq_ids)
        self._trim_padding()

    def _trim_padding(self) -> None:
        """Drop the leading columns that are padding in every remaining row.

        A long-lived running batch absorbs joiners padded to its length; without this, the time
        axis would only grow, and every step would attend over (and every join copy) columns that
        no remaining sequence uses. Positions come from the mask, so they do not change.
        """
        used = self.attention_mask.bool().any(dim=0)  # [T]
        if not bool(used.any()) or bool(used[0]):
            return
        first = int(used.int().argmax())
        self.attention_mask = self.attention_mask[:, first:]
        for layer in self.slabs:
            layer.trim(first)

    def absorb(self, other: BatchState) -> None:
        """Append another batch's rows (iteration-level batching: a batch joins a running one).

        The shorter history is left-padded with masked zeros, so both caches have one length T;
        positions come from the mask, so the joined rows keep theirs.
        """
        length = max(self.length, other.length)
        for mine, theirs in zip(self.slabs, other.slabs, strict=True):
            mine.absorb(theirs)
        self.attention_mask = torch.cat(
            [_left_pad_time(self.attention_mask, length), _left_pad_time(other.attention_mask, length)]
        )
        self.seq_ids += other.seq_ids

    @property
    def length(self) -> int:
        return int(self.attention_mask.shape[1])

    def extend(self, new_tokens: int) -> None:
        ones = torch.ones(self.attention_mask.shape[0], new_tokens, dtype=self.attention_mask.dtype)
        self.attention_mask = torch.cat([self.attention_mask, ones], dim=1)


class StagePartition(nn.Module):
    """Layers [start, stop) of a Llama-family causal LM, plus embedding / head when at an end."""

    embed_tokens: nn.Module | None
    norm: nn.Module | None
    lm_head: nn.Module | None

    def __init__(self, model: Any, layers: LayerRange) -> None:
        super().__init__()
        self.config: PretrainedConfig = model.config
        self.range = layers
        self.is_first = layers.start == 0
        self.is_last = layers.stop == self.config.num_hidden_layers
        body = model.model
        self.embed_tokens = body.embed_tokens if self.is_first else None
        self.layers = nn.ModuleList(body.layers[layers.start : layers.stop])
        self.rotary_emb: Any = body.rotary_emb
        self.norm = body.norm if self.is_last else None
        self.lm_head = model.lm_head if self.is_last else None

    @classmethod
    def load(
        cls,
        path: Path,
        layers: LayerRange | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
    ) -> StagePartition:
        """Build this stage alone: its modules on `device`, its tensors read from the checkpoint."""
        meta = build_on_meta(path, dtype)
        config = meta.config
        layers = layers or LayerRange(0, config.num_hidden_layers)
        stage = cls(meta, layers)
        tied = bool(getattr(config, "tie_word_embeddings", False))
        materialize(stage, path, start=layers.start, device=torch.device(device), dtype=dtype, tied_head=tied)
        if tied and stage.embed_tokens is not None and stage.lm_head is not None:
            stage.lm_head.weight = stage.embed_tokens.weight  # to_empty() does not keep the tie
        with torch.device(device):
            stage.rotary_emb = type(meta.model.rotary_emb)(config=config)  # non-persistent: rebuilt
        return stage.eval()

    @property
    def device(self) -> torch.device:
        return self.rotary_emb.inv_freq.device  # type: ignore[no-any-return]

    def param_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def warmup(self, tokens: int = 16) -> None:
        """One prefill and one decode step on dummy input, so the first real job does not pay
        for the allocator and kernel start-up (about 200 ms on a CPU)."""
        mask = torch.ones(1, tokens, dtype=torch.long)
        state = BatchState(self.config, ["warmup"], mask)
        if self.embed_tokens is not None:
            x = torch.zeros(1, tokens, dtype=torch.long)
        else:
            x = torch.zeros(1, tokens, self.config.hidden_size, dtype=self.hidden_dtype)
        self(state, x)
        state.extend(1)
        self(state, x[:, -1:])

    @property
    def hidden_dtype(self) -> torch.dtype:
        source: Any = self.rotary_emb.inv_freq if self.embed_tokens is None else self.embed_tokens.weight
        return source.dtype  # type: ignore[no-any-return]

    @torch.inference_mode()
    def forward(
        self, state: BatchState, x: torch.Tensor, between_layers: Callable[[], object] | None = None
    ) -> torch.Tensor:
        """Run one step over this stage's layers.

        x: token ids [B, S] on the first stage, hidden states [B, S, D] on the others; the caller
        has already extended `state.attention_mask` to cover these S new positions.
        `between_layers` is called after every layer but the last: the step can be interrupted
        there for other batches' work (it touches nothing of this step's).
        Returns hidden states [B, S, D], or on the last stage the next-token logits [B, V].
        """
        x = x.to(self.device)
        hidden = self.embed_tokens(x) if self.embed_tokens is not None else x  # [B, S, D]
        new = hidden.shape[1]
        mask = state.attention_mask.to(self.device)
        position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)[:, -new:]  # [B, S]
        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=mask,
            cache=state.cache,
            position_ids=position_ids,
            # Layers keep their global index: size the mask from this stage's first cache slot.
            layer_idx=self.range.start,
        )
        position_embeddings = self.rotary_emb(hidden, position_ids=position_ids)
        for index, layer in enumerate(self.layers):
            if index and between_layers is not None:
                between_layers()
            hidden = layer(
                hidden,
                attention_mask=causal_mask,
                position_ids=position_ids,
                cache=state.cache,
                use_cache=True,
                position_embeddings=position_embeddings,
            )
        if self.lm_head is None or self.norm is None:
            return hidden
        return self.lm_head(self.norm(hidden[:, -1, :]))  # [B, V]: only the last position is sampled


def _left_pad_time(mask: torch.Tensor, length: int) -> torch.Tensor:
    """Left-pad an attention mask [B, T] with zeros to [B, length]."""
    missing = length - mask.shape[1]
    if missing == 0:
        return mask
    return torch.cat([mask.new_zeros(mask.shape[0], missing), mask], dim=1)


def left_pad(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B, S] left-padded to the longest, and their attention mask [B, S]."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        if seq:
            ids[row, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
            mask[row, width - len(seq) :] = 1
    return ids, mask
