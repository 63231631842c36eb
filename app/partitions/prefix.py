"""Prefix caching: the keys and values of a prompt's first tokens, computed once per stage and
reused by every later prompt that starts with the same tokens.

Every chat through a model's template starts with the same system prompt; without a cache each
prefill computes it again. After a prefill a stage keeps each prompt's whole blocks (`BLOCK`
tokens) of keys and values for its own layers, and, on a stage that is not the last, its output
hidden states for them (what the next stage would need to compute its own if it misses). A later
prompt looks up its longest cached prefix by a chain of block digests (vLLM's block hashes: one
digest names a block and everything before it) and the tokens are compared before use, so a digest
collision costs a miss, never a wrong answer. An entry stored for a 140-token prompt serves any
prompt sharing its first 16, 32, ... 128 tokens: keys and values at a position depend only on the
tokens up to it.

A batch's rows share one step width: each row computes its last `step` tokens, where `step` is the
longest uncached remainder among them, and takes the tokens before those from its cache entry
(`plan`). Every row stays left-padded (no padding between a row's tokens), so positions, masks,
sliding windows and joins see what an ordinary prefill makes. Each stage decides on its own cache:
stage 0 may reuse a prefix that stage 1 computes again from the hidden states it receives, which
still cover the whole prompt.

Memory: entries are kept under a byte budget per stage, least recently used evicted first; an
entry's prefixes point at the newest entry that holds them, and an entry no prefix points at is
freed at once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from app.partitions.digest import BLOCK, digests
from app.partitions.kvcache import SlabLayer
from app.partitions.layers import BatchState, StagePartition


@dataclass(eq=False)
class Entry:
    """One stored prompt prefix of one stage: `length` tokens, whole blocks."""

    tokens: tuple[int, ...]
    keys: list[torch.Tensor]  # per layer of the stage, [kv heads, length, head dim]
    values: list[torch.Tensor]
    hidden: torch.Tensor | None  # [length, hidden size], the stage's output; None on the last stage
    nbytes: int
    names: list[bytes] = field(default_factory=list)  # its block digests that point at it

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class Hit:
    entry: Entry
    length: int  # tokens of the entry that the prompt starts with (whole blocks)


class PrefixCache:
    """The prompt prefixes one stage holds, under `budget_bytes`."""

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes <= 0:
            raise ValueError("a prefix cache needs a budget above 0 bytes")
        self.budget_bytes = budget_bytes
        self.nbytes = 0
        self._names: dict[bytes, Entry] = {}
        self._entries: OrderedDict[int, Entry] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, ids: Sequence[int]) -> Hit | None:
        """The longest cached prefix of `ids` that leaves at least one token to compute (a prefill
        must run its last token to give the next one)."""
        for length, name in reversed(list(_boundaries(ids, (len(ids) - 1) // BLOCK))):
            entry = self._names.get(name)
            if entry is not None and entry.tokens[:length] == tuple(ids[:length]):
                self._entries.move_to_end(id(entry))
                return Hit(entry, length)
        return None

    def store(
        self,
        ids: Sequence[int],
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        hidden: torch.Tensor | None,
    ) -> Entry | None:
        """Keep a prompt's whole blocks: `keys`/`values` per layer [heads, >= length, dim] and
        `hidden` [>= length, D] start at its first token (copied). None if it holds no whole block
        or would not fit the budget alone; the entry already holding them if there is one."""
        blocks = len(ids) // BLOCK
        length = blocks * BLOCK
        if not blocks:
            return None
        names = _boundaries(ids, blocks)
        held = self._names.get(names[-1][1])
        if held is not None and held.tokens[:length] == tuple(ids[:length]):
            self._entries.move_to_end(id(held))
            return held
        parts = [k[:, :length] for k in keys] + [v[:, :length] for v in values]
        if hidden is not None:
            parts.append(hidden[:length])
        nbytes = sum(t.numel() * t.element_size() for t in parts)
        if nbytes > self.budget_bytes:
            return None
        parts = [t.clone() for t in parts]
        layers = len(keys)
        entry = Entry(
            tuple(ids[:length]),
            parts[:layers],
            parts[layers : 2 * layers],
            parts[2 * layers] if hidden is not None else None,
            nbytes,
        )
        for _, name in names:
            older = self._names.get(name)
            if older is not None:
                older.names.remove(name)
                if not older.names:
                    self._forget(older)
            self._names[name] = entry
            entry.names.append(name)
        self._entries[id(entry)] = entry
        self.nbytes += nbytes
        while self.nbytes > self.budget_bytes:
            self._forget(next(iter(self._entries.values())))
        return entry

    def _forget(self, entry: Entry) -> None:
        for name in entry.names:
            if self._names.get(name) is entry:
                del self._names[name]
        entry.names = []
        if self._entries.pop(id(entry), None) is not None:
            self.nbytes -= entry.nbytes


def _boundaries(ids: Sequence[int], blocks: int) -> list[tuple[int, bytes]]:
    return [((k + 1) * BLOCK, name) for k, name in enumerate(digests(ids, blocks))]


@dataclass(frozen=True)
class Plan:
    """How one prefill batch uses the cache: each row computes its last `step` tokens and takes the
    `reused` tokens before them from `hits`' entries (rows of `lengths` tokens, left-padded to the
    longest)."""

    lengths: list[int]
    step: int
    reused: list[int]
    hits: list[Hit | None]

    @property
    def cached(self) -> int:
        """Columns of the batch's cache before the step: the most any row reuses."""
        return max(self.reused, default=0)

    @property
    def saves(self) -> bool:
        return self.cached > 0


def plan(lengths: list[int], hits: list[Hit | None]) -> Plan:
    """Every row computes the same number of tokens, the longest uncached remainder of any row; a
    row takes what comes before them from its hit (never more than it has: its remainder is no
    longer than the step) and a row shorter than the step computes all of it."""
    remainders = [n - (h.length if h is not None else 0) for n, h in zip(lengths, hits, strict=True)]
    step = max(remainders, default=0)
    reused = [max(0, n - step) for n in lengths]
    return Plan(lengths, step, reused, [h if r else None for h, r in zip(hits, reused, strict=True)])


class Prefill:
    """One prefill batch through one stage and its prefix cache: `start` builds the batch's state
    (reused tokens already in it) and the step's input, `finish` stores the new prefixes and gives
    the output the next stage expects (whole prompts)."""

    def __init__(
        self,
        cache: PrefixCache | None,
        partition: StagePartition,
        seq_ids: list[str],
        prompts: list[list[int]] | None,
        mask: torch.Tensor,
    ) -> None:
        self.cache = cache if prompts is not None else None
        self.partition = partition
        self.seq_ids = seq_ids
        self.prompts = prompts or []
        self.mask = mask  # [B, T], the whole prompts
        self.layers = range(partition.range.start, partition.range.stop)
        lengths = [int(n) for n in mask.sum(dim=1).tolist()]
        hits: list[Hit | None] = [None] * len(lengths)
        if self.cache is not None:
            hits = [self.cache.lookup(p) if self._reusable(p) else None for p in self.prompts]
        self.plan = plan(lengths, hits)

    def _reusable(self, prompt: list[int]) -> bool:
        """Whether the keys of this prompt's blocks are the same whatever prompt they were computed
        for: not past a length-dependent rope's limit (`app.partitions.rope`), where a prompt's
        frequencies are its own length's."""
        limit = self.partition.rope_limit
        return limit is None or len(prompt) <= limit

    @property
    def reused(self) -> int:
        """Prompt tokens this stage takes from its cache instead of computing them."""
        return sum(self.plan.reused)

    @property
    def computed(self) -> int:
        return sum(self.plan.lengths) - self.reused

    def start(self, x: torch.Tensor, *, whole: bool = False) -> tuple[BatchState, torch.Tensor]:
        """The batch's state and the step's input: `x` ([B, T] ids or [B, T, D] hidden) whole, or
        only its last `plan.step` columns with the tokens before them reused. `whole`: reuse
        nothing (a last stage that reads every prompt column's output: echo's logprobs)."""
        if whole:
            self.plan = plan(self.plan.lengths, [None] * len(self.plan.lengths))
        config = self.partition.config
        if not self.plan.saves:
            return BatchState(config, self.seq_ids, self.mask), x
        total, cached, step = self.mask.shape[1], self.plan.cached, self.plan.step
        state = BatchState(config, self.seq_ids, self.mask[:, total - step - cached :])
        if self.partition.keeps_ids:  # the cached columns' ids: the step records its own
            state.ids = x[:, total - step - cached : total - step].to("cpu", torch.long)
        rows = len(self.seq_ids)
        for local, index in enumerate(self.layers):
            sample = next(h.entry.keys[local] for h in self.plan.hits if h is not None)
            keys = sample.new_zeros(rows, sample.shape[0], cached, sample.shape[2])
            values = torch.zeros_like(keys)
            for row, (hit, reused) in enumerate(zip(self.plan.hits, self.plan.reused, strict=True)):
                if hit is not None:
                    keys[row, :, cached - reused :] = hit.entry.keys[local][:, :reused]
                    values[row, :, cached - reused :] = hit.entry.values[local][:, :reused]
            state.slabs[index].preload(keys, values, extra=step)
        return state, x[:, total - step :]

    def finish(self, state: BatchState, out: torch.Tensor) -> torch.Tensor:
        """Store what this prefill adds to the cache; the step's output with every prompt column
        (hidden states [B, T, D]; the last stage's logits as they are)."""
        last = self.partition.is_last
        if self.plan.saves and not last:
            out = self._widen(out)
        if self.cache is not None:
            self._keep(state, None if last else out)
        return out

    def _widen(self, out: torch.Tensor) -> torch.Tensor:
        """[B, step, D] -> [B, T, D]: each row's reused tokens' hidden states from its entry."""
        total = self.mask.shape[1]
        whole = out.new_zeros(out.shape[0], total, out.shape[2])
        whole[:, total - self.plan.step :] = out
        rows = zip(self.plan.hits, self.plan.reused, self.plan.lengths, strict=True)
        for row, (hit, reused, length) in enumerate(rows):
            if hit is not None:
                assert hit.entry.hidden is not None
                whole[row, total - length : total - length + reused] = hit.entry.hidden[:reused]
        return whole

    def _keep(self, state: BatchState, hidden: torch.Tensor | None) -> None:
        """Store each row's prompt whose whole blocks reach past what it reused, its keys and values
        read from the batch's cache. A row whose prompt a sliding layer no longer holds whole is
        skipped."""
        assert self.cache is not None
        slabs: list[SlabLayer] = [state.slabs[i] for i in self.layers]
        held = min(s.length for s in slabs)
        total = self.mask.shape[1]
        for row, (prompt, hit) in enumerate(zip(self.prompts, self.plan.hits, strict=True)):
            length = len(prompt)
            whole = (length // BLOCK) * BLOCK
            if not whole or whole <= (hit.length if hit is not None else 0) or length > held:
                continue
            if not self._reusable(prompt):
                continue
            keys, values = [], []
            for slab in slabs:
                assert slab._k is not None and slab._v is not None
                first = slab.end - length
                keys.append(slab._k[row, :, first : first + whole])
                values.append(slab._v[row, :, first : first + whole])
            own = hidden[row, total - length : total - length + whole] if hidden is not None else None
            self.cache.store(prompt, keys, values, own)
