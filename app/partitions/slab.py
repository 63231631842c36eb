"""The decoding sequences' keys and values, also kept contiguous between steps: a slab per layer.

A ragged step's decode rows find their histories in the paged pools through their block tables
(`app.partitions.paged`); on a CPU reading them there is a gather, a copy of every row's whole
history, in every layer, at every step: at 64 rows of SmolLM2 in bf16 a fifth of the step
(`aten::index_select` in `python -m bench.engine`'s profile). The slab keeps each decoding
sequence at a slot of one [kv heads, slots, positions, head dim] tensor per layer and appends its
new key and value there as it decodes (each is written to its block as well), so a decode step
attends over the whole slab in place (the positions past each row's length and the free slots
masked), as the batch engine attends over its contiguous caches' whole buffers.

The pools stay the truth. Before a step's layers run, `Slab.prepare` brings the slab to the step's
decode rows: a sequence that decodes again, one position longer, keeps its slot; one that starts
decoding (its last prompt chunk ran the step before, or it resumed) is copied from its blocks into
the lowest free slot, once; one that no longer decodes (finished, preempted, aborted) frees its
slot. The slab grows by whole steps of positions and slots (the copy of a growth is spread over
those steps); it is built anew from the pools when half of it would hold nothing (every step
attends over all of it) and dropped when nothing decodes. It costs the memory of the decoding
sequences' caches a second time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

SLOTS_STEP = 4  # slots are added this many at a time
POSITIONS_STEP = 32  # positions are added this many at a time, beyond the longest row's need


@dataclass
class SlabStep:
    """One step's view of the slab: each decode row's slot (in the step's row order), where its new
    key and value go, and the slots and positions the step's attention spans."""

    slots: torch.Tensor  # [B] long
    writes: torch.Tensor  # [B] long: slot x capacity + position, in the flattened slab
    # per slot, positions after the step (0: a free slot). The step attends over every slot and
    # position of the slab's capacity: a contiguous tensor, which a CPU's batched matrix product reads
    # in place (a view of the live ones it copies first: the gather the slab is there to save)
    lengths: tuple[int, ...]
    width: int  # the slab's positions
    ordered: bool  # slot i holds row i, and no slot is free: no reordering of queries
    _allowed: dict[int | None, torch.Tensor] = field(default_factory=dict)

    @property
    def used(self) -> int:
        return len(self.lengths)

    def allowed(self, window: int | None) -> torch.Tensor:
        """[1, slots, 1, width]: which positions each slot's query sees (a free slot: its first,
        whose output is never read), once a step for each window."""
        if window not in self._allowed:
            device = self.slots.device
            column = torch.arange(self.width, device=device)[None, :]  # [1, L]
            at = torch.tensor([max(n, 1) - 1 for n in self.lengths], device=device)[:, None]  # [S, 1]
            allowed = column <= at
            if window is not None:
                allowed &= column > at - window
            self._allowed[window] = allowed[None, :, None, :]
        return self._allowed[window]


class Slab:
    """The slab of one stage's layers (see the module's docstring)."""

    def __init__(
        self,
        layers: Sequence[int],
        *,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.layers = list(layers)
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.reset()

    def reset(self) -> None:
        """Forget every row and free the memory (after a step that raised, or when nothing decodes)."""
        self.slot_of: dict[str, int] = {}
        self.lengths: list[int] = []  # positions held, per slot (0: free)
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.capacity = (0, 0)  # slots, positions

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self.keys.values(), *self.values.values()])

    def prepare(
        self,
        seq_ids: Sequence[str],
        lengths: Sequence[int],
        tables: Sequence[Sequence[int]],
        pools: tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]],
        block_size: int,
    ) -> SlabStep | None:
        """Bring the slab to a step's decode rows (sequence ids, their lengths once the step's
        token is written, block tables), copying a row that starts decoding from `pools` (keys and
        values by layer, [kv heads, blocks, block size, head dim]). None when no row decodes."""
        decoding = dict(zip(seq_ids, lengths, strict=True))
        for seq_id in [s for s in self.slot_of if s not in decoding]:
            self.lengths[self.slot_of.pop(seq_id)] = 0
        capacity, positions = self.capacity
        if (
            not decoding
            or len(decoding) * 2 <= capacity - SLOTS_STEP
            or max(lengths) * 2 <= positions - POSITIONS_STEP
        ):
            self.reset()  # nothing decodes, or half the slab would be attended over for nothing: anew
        if not decoding:
            return None
        fills: list[tuple[int, int, Sequence[int]]] = []  # slot, positions held, blocks
        for seq_id, n, table in zip(seq_ids, lengths, tables, strict=True):
            slot = self.slot_of.get(seq_id)
            if slot is not None and self.lengths[slot] == n - 1:
                continue
            if slot is None:
                slot = self._free_slot()
                self.slot_of[seq_id] = slot
            fills.append((slot, n - 1, table))
            self.lengths[slot] = n - 1
        while self.lengths and self.lengths[-1] == 0 and len(self.lengths) - 1 not in self.slot_of.values():
            self.lengths.pop()
        width = max(lengths)
        self._reserve(len(self.lengths), -(-width // block_size) * block_size)
        if fills:
            self._fill(fills, pools, block_size)
        rows = [self.slot_of[s] for s in seq_ids]
        for slot, n in zip(rows, lengths, strict=True):
            self.lengths[slot] = n
        capacity, positions = self.capacity
        return SlabStep(
            torch.tensor(rows, dtype=torch.long, device=self.device),
            torch.tensor(
                [s * positions + n - 1 for s, n in zip(rows, lengths, strict=True)], device=self.device
            ),
            (*self.lengths, *[0] * (capacity - len(self.lengths))),
            positions,
            rows == list(range(capacity)),
        )

    def _free_slot(self) -> int:
        taken = set(self.slot_of.values())
        for slot, n in enumerate(self.lengths):
            if n == 0 and slot not in taken:
                return slot
        self.lengths.append(0)
        return len(self.lengths) - 1

    def _reserve(self, slots: int, positions: int) -> None:
        """Room for `slots` slots of `positions` positions, the rows held so far kept."""
        have_slots, have_positions = self.capacity
        if slots <= have_slots and positions <= have_positions:
            return
        new = (
            max(have_slots, -(-slots // SLOTS_STEP) * SLOTS_STEP),
            max(have_positions, -(-(positions + POSITIONS_STEP) // POSITIONS_STEP) * POSITIONS_STEP),
        )
        shape = (self.kv_heads, *new, self.head_dim)
        for tensors in (self.keys, self.values):
            for layer in self.layers:
                grown = torch.zeros(shape, dtype=self.dtype, device=self.device)
                old = tensors.get(layer)
                if old is not None:
                    grown[:, :have_slots, :have_positions] = old
                tensors[layer] = grown
        self.capacity = new

    def _fill(
        self,
        fills: list[tuple[int, int, Sequence[int]]],
        pools: tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]],
        block_size: int,
    ) -> None:
        """Copy each (slot, positions, blocks) row's first positions from the pools, every layer:
        one gather of all the rows' blocks (padded with block 0, whose positions are past each
        row's length: masked, and overwritten as the row decodes) and one copy into their slots."""
        count = max(-(-n // block_size) for _, n, _ in fills) or 1
        blocks = torch.tensor(
            [list(table[:count]) + [0] * (count - len(table[:count])) for _, _, table in fills],
            dtype=torch.long,
            device=self.device,
        ).reshape(-1)
        slots = torch.tensor([slot for slot, _, _ in fills], dtype=torch.long, device=self.device)
        span = count * block_size
        for source, tensors in zip(pools, (self.keys, self.values), strict=True):
            for layer in self.layers:
                pool = source[layer]
                rows = pool.index_select(1, blocks).view(self.kv_heads, len(fills), span, self.head_dim)
                tensors[layer][:, :, :span].index_copy_(1, slots, rows.to(self.dtype))

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, step: SlabStep) -> None:
        """Append the decode rows' new keys/values [B, kv heads, head dim] at their slots."""
        for tensors, new in ((self.keys, key), (self.values, value)):
            flat = tensors[layer].view(self.kv_heads, -1, self.head_dim)
            flat.index_copy_(1, step.writes, new.transpose(0, 1).to(self.dtype))

    def view(self, layer: int, step: SlabStep) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values the step attends over: the whole slab, [kv heads, slots, positions,
        head dim]."""
        return self.keys[layer], self.values[layer]
