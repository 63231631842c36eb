"""SlabLayer against the plain concatenating cache it replaces: same keys and values after any
sequence of decode steps, finished rows, joining batches and trimmed padding."""

from __future__ import annotations

import random

import pytest
import torch

from app.partitions.kvcache import SlabLayer

HEADS, DIM = 2, 4


class Plain:
    """The reference: whole tensors, concatenated and indexed, as DynamicLayer and the old BatchState."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys, self.values = keys, values

    def update(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.keys = torch.cat([self.keys, k], dim=2)
        self.values = torch.cat([self.values, v], dim=2)

    def select(self, rows: list[int]) -> None:
        self.keys, self.values = self.keys[rows], self.values[rows]

    def trim(self, columns: int) -> None:
        self.keys, self.values = self.keys[:, :, columns:], self.values[:, :, columns:]

    def absorb(self, other: Plain) -> None:
        length = max(self.keys.shape[2], other.keys.shape[2])
        self.keys = torch.cat([pad(self.keys, length), pad(other.keys, length)])
        self.values = torch.cat([pad(self.values, length), pad(other.values, length)])


def pad(x: torch.Tensor, length: int) -> torch.Tensor:
    missing = length - x.shape[2]
    return torch.cat([x.new_zeros(x.shape[0], x.shape[1], missing, x.shape[3]), x], dim=2)


def kv(rows: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(rows, HEADS, length, DIM), torch.randn(rows, HEADS, length, DIM)


def fresh(rows: int, length: int) -> tuple[SlabLayer, Plain]:
    k, v = kv(rows, length)
    slab = SlabLayer()
    with torch.inference_mode():
        slab.update(k, v)
    return slab, Plain(k, v)


def step(slab: SlabLayer, plain: Plain, rows: int) -> None:
    """One decode step's new column on both caches."""
    k, v = kv(rows, 1)
    with torch.inference_mode():
        slab.update(k, v)
    plain.update(k, v)


def same(slab: SlabLayer, plain: Plain) -> None:
    assert slab.keys is not None and slab.values is not None
    assert torch.equal(slab.keys, plain.keys)
    assert torch.equal(slab.values, plain.values)
    assert slab.get_seq_length() == (plain.keys.shape[2] if plain.keys.shape[0] else 0)


def test_decode_steps_write_in_place_until_the_buffer_is_outgrown() -> None:
    slab, plain = fresh(3, 5)
    buffer = slab._k
    for _ in range(40):
        k, v = kv(3, 1)
        with torch.inference_mode():
            keys, values = slab.update(k, v)
        plain.update(k, v)
        same(slab, plain)
        assert buffer is not None and keys.data_ptr() == buffer.data_ptr()  # no copy
    for _ in range(200):  # past the spare columns: reallocated once, then in place again
        step(slab, plain, 3)
    same(slab, plain)


def test_rows_leave_in_any_order() -> None:
    slab, plain = fresh(6, 7)
    for rows in ([0, 2, 3, 5], [3, 1, 0], [2], [0]):
        slab.select(rows)
        plain.select(rows)
        same(slab, plain)


@pytest.mark.parametrize("host_len, joiner_len", [(9, 4), (4, 9), (6, 6)])
def test_a_joining_batch_is_padded_to_the_longer_history(host_len: int, joiner_len: int) -> None:
    slab, plain = fresh(3, host_len)
    joiner, joiner_plain = fresh(2, joiner_len)
    slab.absorb(joiner)
    plain.absorb(joiner_plain)
    same(slab, plain)
    step(slab, plain, 5)
    same(slab, plain)


def test_a_random_life_matches_the_plain_cache() -> None:
    """Decode steps, finished rows, joins (shorter and longer, past the spare rows) and trims, at random."""
    rng = random.Random(7)
    torch.manual_seed(7)
    slab, plain = fresh(4, 6)
    for _ in range(300):
        rows = plain.keys.shape[0]
        op = rng.random()
        if op < 0.55 and rows:
            step(slab, plain, rows)
        elif op < 0.75 and rows > 1:
            kept = sorted(rng.sample(range(rows), rng.randint(1, rows - 1)))
            if rng.random() < 0.3:
                rng.shuffle(kept)
            slab.select(kept)
            plain.select(kept)
        elif op < 0.9 and rows < 40:
            joiner, joiner_plain = fresh(rng.randint(1, 6), rng.randint(1, plain.keys.shape[2] + 12))
            slab.absorb(joiner)
            plain.absorb(joiner_plain)
        elif plain.keys.shape[2] > 2:
            columns = rng.randint(1, 2)
            slab.trim(columns)
            plain.trim(columns)
        same(slab, plain)


def test_absorbing_into_a_layer_without_cache_is_refused() -> None:
    joiner, _ = fresh(1, 3)
    with pytest.raises(RuntimeError, match="empty cache layer"):
        SlabLayer().absorb(joiner)
