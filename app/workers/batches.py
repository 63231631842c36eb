"""The batches one stage holds between steps, one record each: no Redis, no messages sent.

`StageRuntime` (`app.workers.stage`) does the I/O around it. A record holds the batch's KV cache
and mask (`BatchState`), when it was last stepped, whether its prefill is running, and on the last
stage its sequences, its routes and the batches waiting to join it. The contract follows TGI's
`Batch`: `begin` (from_requests), `resume` (filter, then concatenate the joining batches), `drop`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from app.core.protocol import StepMessage
from app.partitions.layers import BatchState
from app.workers.decode import Sequence


class BatchGone(LookupError):
    """A step for a batch this stage no longer holds (dropped as stale, or held by a replica that
    restarted): its jobs were, or will be, recovered by the monitor; nothing here fails them."""


@dataclass(frozen=True)
class Join:
    """A batch prefilled while another was running, waiting at the last stage to join it."""

    msg: StepMessage
    alive: list[tuple[str, int]]  # (job id, first sampled token) of its unfinished sequences


@dataclass
class Running:
    """What this stage keeps of one batch."""

    state: BatchState
    touched: float  # monotonic time of its last step: a batch not stepped for long lost a stage
    # Last stage only. `routes` is None on other stages, and once the batch's sequences have moved
    # into the batch it joined (its rows follow at that batch's next step).
    routes: list[str | None] | None = None
    sequences: dict[str, Sequence] = field(default_factory=dict)
    joins: list[Join] = field(default_factory=list)  # batches waiting to join this one
    prefilling: bool = False  # its prefill is running (an urgent prefill may run inside it)

    def size(self) -> int:
        """Its sequences, the ones waiting to join it included."""
        return len(self.sequences) + sum(len(join.alive) for join in self.joins)


class Batches:
    """The running batches of one stage, by batch id."""

    def __init__(self) -> None:
        self._running: dict[str, Running] = {}

    def __len__(self) -> int:
        return len(self._running)

    def __contains__(self, batch_id: object) -> bool:
        return batch_id in self._running

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._running))

    def __getitem__(self, batch_id: str) -> Running:
        return self._running[batch_id]

    def get(self, batch_id: str) -> Running | None:
        return self._running.get(batch_id)

    def clear(self) -> None:
        self._running.clear()

    def begin(
        self,
        batch_id: str,
        state: BatchState,
        now: float,
        *,
        routes: list[str | None] | None = None,
        sequences: dict[str, Sequence] | None = None,
    ) -> Running:
        """A new batch (its prefill). `routes` and `sequences` on the last stage only."""
        state.batch_ids = {batch_id}
        held = self._running.get(batch_id)  # a prefill delivered again: batches waiting stay parked
        running = Running(state, now, routes=routes, sequences=sequences or {})
        running.joins = held.joins if held is not None else []
        self._running[batch_id] = running
        return running

    def touch(self, batch_id: str, now: float) -> None:
        running = self._running.get(batch_id)
        if running is not None:
            running.touched = now

    def stale(self, now: float, after_s: float) -> list[tuple[str, float]]:
        """The batches not stepped for more than `after_s`, with the seconds since their last step."""
        return [(b, now - r.touched) for b, r in self._running.items() if now - r.touched > after_s]

    def drop(self, batch_id: str) -> list[Join]:
        """Forget a batch; the batches that were waiting to join it (each still held here)."""
        running = self._running.pop(batch_id, None)
        return running.joins if running is not None else []

    def resume(self, batch_id: str, merge: list[str], seq_ids: list[str]) -> BatchState:
        """A decode step: keep the rows of `seq_ids` (finished ones leave), append the rows of the
        batches in `merge` (they are forgotten as batches of their own), make room for one token."""
        missing = [b for b in (batch_id, *merge) if b not in self._running]
        if missing:
            raise BatchGone(f"this stage holds no state for batch {', '.join(missing)}")
        state = self._running[batch_id].state
        joining = [self._running.pop(b).state for b in merge]
        for part in (state, *joining):
            mine = set(part.seq_ids)
            part.keep([s for s in seq_ids if s in mine])
        for other in joining:
            state.absorb(other)
        if state.seq_ids != seq_ids:
            raise RuntimeError(f"batch {batch_id}: rows out of step with the message")
        state.extend(1)
        return state

    # --- the last stage: joins ------------------------------------------------------------------

    def park(self, host: str, join: Join) -> None:
        """`join` waits for `host`'s next step to join it."""
        self._running[host].joins.append(join)

    def take_joins(self, host: str) -> list[Join]:
        """The batches joining `host` now: their sequences become `host`'s (their KV rows follow at
        `host`'s next step, see `resume`), and they are no longer join hosts themselves."""
        running = self._running[host]
        joins, running.joins = running.joins, []
        for join in joins:
            joiner = self._running[join.msg.batch_id]
            running.sequences.update(joiner.sequences)
            joiner.sequences, joiner.routes = {}, None
        return joins

    def host_for(
        self,
        batch_id: str,
        routes: list[str | None],
        num_stages: int,
        size: int,
        *,
        max_running: int,
        max_kv_positions: int,
    ) -> str | None:
        """The smallest running batch on the same replicas with room, if the pipeline stays full.

        A pipeline of N stages needs N batches circulating to keep every stage busy, so a new batch
        joins another only when at least N others run on its replicas (they hold its KV cache).
        """
        waiting = {join.msg.batch_id for r in self._running.values() for join in r.joins}
        sizes = {
            b: r.size()
            for b, r in self._running.items()
            if r.routes is not None
            and b != batch_id
            and b not in waiting
            and not r.prefilling  # it may itself join another, leaving us behind
            and r.routes == routes
        }
        if len(sizes) < num_stages:
            return None
        host = min(sizes, key=lambda b: sizes[b])
        if sizes[host] + size > max_running:
            return None
        fits = self.merged_positions(host, batch_id, sizes[host] + size) <= max_kv_positions
        return host if fits else None

    def merged_positions(self, host: str, joiner: str, rows: int) -> int:
        """KV positions of `host` once `joiner` (and the batches already waiting to join it) are in:
        every row padded to the longest of them, plus the step about to be taken."""
        parts = [host, joiner, *(j.msg.batch_id for j in self._running[host].joins)]
        longest = max(self._running[b].state.length for b in parts if b in self._running)
        return rows * (longest + 1)
