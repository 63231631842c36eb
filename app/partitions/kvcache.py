"""One attention layer's KV cache for a running batch, kept in a buffer with room to grow.

transformers' `DynamicLayer` concatenates every new token onto the cache, so each decode step
copies the whole cache of every layer, and a batch that joins or loses rows is copied again.
`SlabLayer` holds keys and values in one preallocated buffer per tensor, [rows, heads, time, dim],
whose live part is rows [0, rows) and time [start, end); what attention reads is a view of it.
A decode step writes one column in place, a joining batch is written into spare rows, finished
rows are closed up by moving only the rows behind the first gap, and leading padding is dropped
by moving `start`. The buffer is reallocated (with room to spare) only when it is outgrown.

Columns that are padding for a row (left padding, or a joined batch shorter than its host) are
zero: attention masks them, and a zero times a masked weight stays zero where garbage could be NaN.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

MIN_SPARE_COLUMNS = 64  # tokens a reallocated buffer can take before the next reallocation
MIN_SPARE_ROWS = 8  # sequences a reallocated buffer can take in before the next one


def _spare(used: int, least: int) -> int:
    return max(least, used // 4)


class SlabLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values are views of a buffer with spare rows and columns."""

    def __init__(self) -> None:
        super().__init__()
        self._k: torch.Tensor | None = None  # [row capacity, heads, time capacity, dim]
        self._v: torch.Tensor | None = None
        self.rows = 0
        self.start = 0
        self.end = 0
        self.wide = False  # `update` hands back `wide_views()` (set around a step by its stage)

    @property
    def length(self) -> int:
        return self.end - self.start

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append `key_states`/`value_states` [rows, heads, new, dim]; return the whole cache (views)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        rows, new = key_states.shape[0], key_states.shape[2]
        if self._k is None:
            self.rows = rows
            self._reallocate(key_states, value_states, rows=rows, length=0, extra=new)
        elif rows != self.rows:
            raise RuntimeError(f"cache holds {self.rows} rows, the step has {rows}")
        elif self.end + new > self._k.shape[2]:
            self._reallocate(key_states, value_states, rows=rows, length=self.length, extra=new)
        assert self._k is not None and self._v is not None
        self._k[:rows, :, self.end : self.end + new] = key_states
        self._v[:rows, :, self.end : self.end + new] = value_states
        self.end += new
        views = self._views()
        return self.wide_views() if self.wide else views

    @torch.inference_mode()
    def preload(self, keys: torch.Tensor, values: torch.Tensor, extra: int) -> None:
        """Start from keys/values [rows, heads, columns, dim] computed earlier (a cached prompt
        prefix, `app.partitions.prefix`), with room for `extra` more columns; the layer must be empty."""
        if self._k is not None:
            raise RuntimeError("cannot preload a cache layer that already holds columns")
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        self.rows = keys.shape[0]
        self._reallocate(keys, values, rows=self.rows, length=keys.shape[2], extra=extra)
        assert self._k is not None and self._v is not None
        self._k[: self.rows, :, : self.end] = keys
        self._v[: self.rows, :, : self.end] = values
        self._views()

    def wide_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the live rows over every column of the buffer, [rows, heads, column
        capacity, dim]: contiguous, which a CPU's batched matrix product needs to be fast (a view of
        the live columns is 2x slower to attend over than all of them). The columns outside
        [start, end) are zeros or a moved row's old history: the step's mask must exclude them."""
        assert self._k is not None and self._v is not None
        return self._k[: self.rows], self._v[: self.rows]

    def reserve(self, columns: int) -> None:
        """Room for `columns` more time steps after `end`, reallocating if the buffer is full (a
        step that writes into the buffer itself, `app.partitions.static`, asks first)."""
        if self._k is None or self._v is None:
            raise RuntimeError("cannot reserve columns in an empty cache layer")
        if self.end + columns > self._k.shape[2]:
            self._reallocate(self._k, self._v, rows=self.rows, length=self.length, extra=columns)

    def advance(self, columns: int) -> None:
        """The next `columns` columns after `end` were written in place: they are live now."""
        assert self._k is not None and self.end + columns <= self._k.shape[2]
        self.end += columns
        self._views()

    @torch.inference_mode()  # the buffers were made in inference mode (the forward's)
    def select(self, rows: list[int]) -> None:
        """Keep these rows, in this order (indices into the current rows). Only the rows whose
        place changes are copied: rows that stay where they are cost nothing, so an order that
        fills the places of the rows leaving with the last rows (the one the last stage sends)
        moves as many rows as leave, where keeping the old order moves every row behind the first
        gap."""
        if self._k is None or self._v is None:
            return
        moved = [i for i, r in enumerate(rows) if r != i]
        if moved:
            device = self._k.device
            source = torch.tensor([rows[i] for i in moved], dtype=torch.long, device=device)
            # every place from the first moved one on: a slice, written faster than an index
            to: slice | torch.Tensor = slice(moved[0], len(rows))
            if len(moved) != len(rows) - moved[0]:
                to = torch.tensor(moved, dtype=torch.long, device=device)
            live = slice(self.start, self.end)
            # The gather copies before the write, so rows may move onto rows that move later.
            self._k[to, :, live] = self._k[source, :, live]
            self._v[to, :, live] = self._v[source, :, live]
        self.rows = len(rows)
        self._views()

    def trim(self, columns: int) -> None:
        """Forget the first `columns` time steps (padding in every remaining row)."""
        if self._k is None:
            return
        self.start += min(columns, self.length)
        self._views()

    @torch.inference_mode()
    def absorb(self, other: SlabLayer) -> None:
        """Append `other`'s rows; the shorter history is left-padded with zeros to the longer."""
        if other._k is None or other._v is None:
            return
        if self._k is None or self._v is None:
            raise RuntimeError("cannot absorb into an empty cache layer")
        length = max(self.length, other.length)
        rows = self.rows + other.rows
        if rows > self._k.shape[0] or length > self.length + self.start:
            self._reallocate(self._k, self._v, rows=rows, length=length)
        elif length > self.length:  # room on the left: widen in place
            grow = length - self.length
            self._k[: self.rows, :, self.start - grow : self.start] = 0
            self._v[: self.rows, :, self.start - grow : self.start] = 0
            self.start -= grow
        joined = slice(self.rows, rows)
        pad = self.end - other.length
        self._k[joined, :, self.start : pad] = 0
        self._v[joined, :, self.start : pad] = 0
        self._k[joined, :, pad : self.end] = other._k[: other.rows, :, other.start : other.end]
        self._v[joined, :, pad : self.end] = other._v[: other.rows, :, other.start : other.end]
        self.rows = rows
        self._views()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.select([int(i) for i in indices.tolist()])

    def _reallocate(
        self, keys: torch.Tensor, values: torch.Tensor, *, rows: int, length: int, extra: int = 0
    ) -> None:
        """A new zeroed buffer for `rows` x (`length` + `extra`) and spare room. The live part is
        copied to the right end of columns [0, length): a longer `length` left-pads it with zeros."""
        heads, dim = keys.shape[1], keys.shape[3]
        row_capacity = rows + _spare(rows, MIN_SPARE_ROWS)
        columns = length + extra + _spare(length + extra, MIN_SPARE_COLUMNS)
        new_k = keys.new_zeros(row_capacity, heads, columns, dim)
        new_v = values.new_zeros(row_capacity, heads, columns, dim)
        if self._k is not None and self._v is not None and self.length:
            offset = length - self.length
            new_k[: self.rows, :, offset:length] = self._k[: self.rows, :, self.start : self.end]
            new_v[: self.rows, :, offset:length] = self._v[: self.rows, :, self.start : self.end]
        self.start, self.end = 0, length
        self._k, self._v = new_k, new_v

    def _views(self) -> tuple[torch.Tensor, torch.Tensor]:
        assert self._k is not None and self._v is not None
        self.keys = self._k[: self.rows, :, self.start : self.end]
        self.values = self._v[: self.rows, :, self.start : self.end]
        return self.keys, self.values

    @torch.inference_mode()
    def replace_rows(self, rows: list[int], other: SlabLayer) -> None:
        """Give `rows` the last columns of `other`'s rows, in order (rows computed again whole): as
        many as both hold, the rest of those rows being their left padding."""
        assert self._k is not None and self._v is not None and other._k is not None and other._v is not None
        n = min(self.length, other.length)
        index = torch.tensor(rows, dtype=torch.long, device=self._k.device)
        self._k[index, :, self.end - n : self.end] = other._k[: other.rows, :, other.end - n : other.end]
        self._v[index, :, self.end - n : self.end] = other._v[: other.rows, :, other.end - n : other.end]
        self._views()


class SlidingSlabLayer(SlabLayer):
    """A sliding-window layer's cache: it keeps only the last `window - 1` columns between steps.

    A step attends over what is kept plus its new columns (the query at column q sees keys in
    (q - window, q]); afterwards the older columns are forgotten by moving `start`, so the cache of
    a long sequence holds `window - 1` columns, not its whole history. The buffer is compacted to
    the kept part whenever it is reallocated.
    """

    def __init__(self, window: int) -> None:
        super().__init__()
        self.window = window

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        self.keep_last(self.window - 1)
        return keys, values  # this step still sees its whole window: the views taken before the cut

    def keep_last(self, columns: int) -> None:
        """Forget all but the last `columns` time steps."""
        if self._k is None or self.length <= columns:
            return
        self.start = self.end - columns
        self._views()
