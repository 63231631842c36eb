"""What one stage remembers about one batch between steps (`BatchState`), and how a batch's prompts
are laid out (`left_pad`). `StagePartition` (`app.partitions.layers`) runs the steps.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PretrainedConfig

from app.partitions.families import SLIDING, attention_kinds
from app.partitions.kvcache import SlabLayer, SlidingSlabLayer


class BatchState:
    """What one stage remembers about one batch between steps."""

    def __init__(self, config: PretrainedConfig, seq_ids: list[str], attention_mask: torch.Tensor) -> None:
        self.cache = DynamicCache(config=config)
        window = int(getattr(config, "sliding_window", None) or 0)
        # One slab per layer of the whole model (layers keep their global index); a sliding layer's
        # slab keeps only its window.
        self.cache.layers = [
            SlidingSlabLayer(window) if kind == SLIDING else SlabLayer() for kind in attention_kinds(config)
        ]
        self.seq_ids = list(seq_ids)
        self.attention_mask = attention_mask  # [B, T] 1 = real token, 0 = left padding
        # The token ids of the whole history [B, T], aligned with the mask: kept by a first stage
        # that may have to compute a row again whole (`StagePartition.keeps_ids`); else None.
        self.ids: torch.Tensor | None = None
        # The batches whose rows this state holds: its own, then every batch that joined it. A job's
        # record names the batch it was scheduled in; only those are this state's to fail.
        self.batch_ids: set[str] = set()
        # A last stage's prefill of prompts whose logprobs are asked (echo) keeps the step's final
        # hidden states [B, S, D] in `hidden`, for the stage to read once.
        self.keep_hidden = False
        self.hidden: torch.Tensor | None = None

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
        if self.ids is not None:
            self.ids = self.ids[torch.tensor(rows, dtype=torch.long)]
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
        if self.ids is not None:
            self.ids = self.ids[:, first:]
        for layer in self.slabs:
            if isinstance(layer, SlidingSlabLayer):
                layer.keep_last(min(self.length, layer.window - 1))  # it holds the last columns only
            else:
                layer.trim(first)

    def absorb(self, other: BatchState) -> None:
        """Append another batch's rows (iteration-level batching: a batch joins a running one).

        The shorter history is left-padded with masked zeros, so both caches have one length T;
        positions come from the mask, so the joined rows keep theirs. Caches are right-aligned
        with the mask, so a sliding layer's last columns stay the mask's last columns.
        """
        length = max(self.length, other.length)
        for mine, theirs in zip(self.slabs, other.slabs, strict=True):
            mine.absorb(theirs)
        self.attention_mask = torch.cat(
            [_left_pad_time(self.attention_mask, length), _left_pad_time(other.attention_mask, length)]
        )
        if self.ids is not None and other.ids is not None:
            self.ids = torch.cat([_left_pad_time(self.ids, length), _left_pad_time(other.ids, length)])
        else:
            self.ids = None
        self.seq_ids += other.seq_ids
        self.batch_ids |= other.batch_ids

    @property
    def length(self) -> int:
        return int(self.attention_mask.shape[1])

    def extend(self, new_tokens: int) -> None:
        ones = torch.ones(self.attention_mask.shape[0], new_tokens, dtype=self.attention_mask.dtype)
        self.attention_mask = torch.cat([self.attention_mask, ones], dim=1)


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
