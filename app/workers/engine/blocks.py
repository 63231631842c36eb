"""The KV block pool of one pipeline replica: which blocks hold which sequence's keys and values.

A paged KV cache (`app.partitions.paged`) is `num_blocks` blocks of `block_size` token positions
on every stage; this pool decides, in stage 0's worker, which block each sequence's next positions
go to. Every stage holds the same blocks at the same indices, so one block table serves them all.

- A sequence's block table grows as its tokens are scheduled (`grow`) and is given back whole when
  it finishes or is preempted (`free`); every position keeps its block meanwhile (a sliding-window
  layer's blocks behind its window are not given back early: the tables serve every layer).
- A block whose `block_size` tokens have all been computed is named by its chain digest
  (`app.partitions.digest`, as today's prefix cache names them) and stays cached after its
  sequence lets go of it, until the pool needs it for something else. A later sequence whose ids
  start with the same whole blocks takes them (`hits`, `take`) instead of computing them: a block
  may then be in several tables at once (its reference count). Each hit's own token ids are
  compared too, so a digest collision costs a miss.
- Blocks no table holds are in one free queue, the next to be reused first: blocks holding nothing
  worth keeping at the head, cached ones at the tail in the order they were let go (least recently
  used first; a sequence's blocks are let go last block first, so its prefix outlives its tail).

The scheduler (`app.workers.engine.scheduler`) is the only caller.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from app.partitions.digest import digests


@dataclass
class Block:
    index: int
    refs: int = 0  # block tables holding it
    digest: bytes | None = None  # set once its tokens are all computed: it may be shared
    tokens: tuple[int, ...] = ()  # its own token ids, compared on a hit


class BlockPool:
    """`num_blocks` blocks of `block_size` positions, their tables by sequence id, and the cache of
    computed whole blocks by digest."""

    def __init__(self, num_blocks: int, block_size: int, *, caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("a block pool needs at least one block of at least one position")
        self.block_size = block_size
        self.caching = caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # next reused first
        self._cached: dict[bytes, Block] = {}
        self._tables: dict[str, list[int]] = {}
        self._digests: dict[str, list[bytes]] = {}  # per sequence, the digests of its committed blocks

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def free_blocks(self) -> int:
        """Blocks no table holds (cached ones included: they are given up when needed)."""
        return len(self._free)

    @property
    def cached_blocks(self) -> int:
        return len(self._cached)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def table(self, seq_id: str) -> tuple[int, ...]:
        return tuple(self._tables.get(seq_id, ()))

    def refs(self, index: int) -> int:
        return self.blocks[index].refs

    def hits(self, ids: Sequence[int]) -> list[int]:
        """The cached blocks of the longest run of whole blocks `ids` starts with, leaving at least
        one token to compute (a step must run a sequence's last token to sample the next). No side
        effects: `take` holds them."""
        if not self.caching:
            return []
        size, found = self.block_size, []
        for k, name in enumerate(digests(ids, (len(ids) - 1) // size, size)):
            block = self._cached.get(name)
            if block is None or block.tokens != tuple(ids[k * size : (k + 1) * size]):
                break
            found.append(block.index)
        return found

    def needed(self, seq_id: str, tokens: int, hits: Sequence[int] = ()) -> int:
        """Blocks to take from the free queue for the table of `seq_id` (or a new one starting with
        `hits`) to cover `tokens` positions: the new blocks, and the hits nobody holds now."""
        held = len(self._tables.get(seq_id, ())) or len(hits)
        idle_hits = sum(1 for i in hits if not self.blocks[i].refs)
        return max(0, self.blocks_for(tokens) - held) + idle_hits

    def take(self, seq_id: str, hits: Sequence[int]) -> None:
        """Start the table of `seq_id` with the cached blocks `hits` (from `hits`)."""
        if seq_id in self._tables:
            raise ValueError(f"{seq_id} already holds blocks")
        for index in hits:
            self._hold(index)
        self._tables[seq_id] = list(hits)
        self._digests[seq_id] = [self.blocks[i].digest for i in hits]  # type: ignore[misc]

    def grow(self, seq_id: str, tokens: int) -> bool:
        """Make the table of `seq_id` cover `tokens` positions; False (and nothing taken) if the free
        queue is too short."""
        table = self._tables.setdefault(seq_id, [])
        self._digests.setdefault(seq_id, [])
        missing = self.blocks_for(tokens) - len(table)
        if missing > len(self._free):
            return False
        for _ in range(missing):
            index, _ = self._free.popitem(last=False)
            self._evict(self.blocks[index])
            self.blocks[index].refs = 1
            table.append(index)
        return True

    def commit(self, seq_id: str, ids: Sequence[int], computed: int) -> None:
        """The first `computed` positions of `seq_id` (token ids `ids`) are computed: name its whole
        blocks among them, so later sequences can share them. A digest already cached keeps its
        block (this one stays private to its sequence)."""
        if not self.caching:
            return
        table, names = self._tables[seq_id], self._digests[seq_id]
        whole = min(computed // self.block_size, len(table))
        if whole <= len(names):
            return
        size = self.block_size
        chain = digests(ids, whole, size)
        for k in range(len(names), whole):
            names.append(chain[k])
            block = self.blocks[table[k]]
            if chain[k] not in self._cached and block.digest is None:
                block.digest, block.tokens = chain[k], tuple(ids[k * size : (k + 1) * size])
                self._cached[chain[k]] = block

    def free(self, seq_id: str) -> None:
        """Let go of the table of `seq_id` (finished or preempted), its last block first."""
        self._digests.pop(seq_id, None)
        for index in reversed(self._tables.pop(seq_id, [])):
            block = self.blocks[index]
            block.refs -= 1
            if not block.refs:
                self._free[index] = None
                if block.digest is None:
                    self._free.move_to_end(index, last=False)  # nothing to keep: reused first

    def _hold(self, index: int) -> None:
        block = self.blocks[index]
        if not block.refs:
            del self._free[index]
        block.refs += 1

    def _evict(self, block: Block) -> None:
        if block.digest is not None:
            if self._cached.get(block.digest) is block:
                del self._cached[block.digest]
            block.digest, block.tokens = None, ()
