"""The step scheduler of one pipeline replica: which tokens of which sequences the next step runs.

It lives in stage 0's worker, the process that owns the replica's KV budget (`BlockPool`), and is
the one decider of a step: `schedule()` returns an immutable `StepPlan`, the stages run it, the last
stage's sampled tokens come back to `update(plan, sampled)`, which appends them, ends the sequences
that are done and frees their blocks. `credit()` tells the batcher how much more it may send.

A step is ragged: every row is one sequence's next tokens at its own positions, all rows in one flat
batch of at most `max_num_batched_tokens` tokens and `max_num_seqs` sequences. The rules, in order:

1. An arrival of a more urgent class (a lower `rank`) than some running sequence is admitted first,
   taking a sequence slot and the blocks of its first chunk from the running sequences of a less
   urgent class, the least urgent and latest arrived first (they are preempted).
2. Decode rows (a running sequence with one token to run) go first, most urgent first: a prefill,
   however long, delays them by at most the one chunk that shares their step.
3. Then prefill chunks: running sequences' unfinished prompts, then waiting sequences, by
   (class rank, arrival), each a chunk of what the token budget has left. A waiting sequence
   starts with the cached blocks its ids begin with (`BlockPool.hits`) and computes only the rest
   (unless it computes every id itself, `Seq.reuse`: a prompt whose logprobs are asked for).
   The first waiting sequence that does not fit ends the step's admissions (no overtaking), and a
   step that preempted admits no more (the pool is short).
4. A running sequence whose next tokens need a block when none is free preempts the least urgent,
   latest arrived running sequence (possibly itself) until they fit. Preemption is by recompute:
   the sequence's blocks are freed and it waits again with its prompt and the tokens it has
   generated as the ids to compute; its whole blocks stay cached, so it usually resumes cheaply.

A pipeline of several stages keeps several plans in flight (`SchedulerConfig.max_in_flight`, one
per stage: while stage 1 runs step k, stage 0 runs step k + 1). A sequence in a plan not yet
updated is in none of the plans after it and is never preempted (a later stage may still be
writing its blocks); plans are updated in the order they were made. `schedule(max_seqs=...)` caps
a plan's rows, so that the running sequences split into as many micro-batches as there are stages.

The sequences, their states and the plan follow vLLM v1's scheduler (`Request`, `RequestStatus`,
`SchedulerOutput`); nothing here knows about Redis, torch or the stages.
"""

from __future__ import annotations

import enum
import itertools
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from app.core.credit import prompt_blocks
from app.workers.engine.blocks import BlockPool


class SeqState(enum.IntEnum):
    """A sequence's state; every state from FINISHED_STOPPED on is final (`is_finished`)."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # waiting again, its blocks given back: it recomputes its ids when resumed
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= SeqState.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    SeqState.FINISHED_STOPPED: "stop",
    SeqState.FINISHED_LENGTH: "length",
    SeqState.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False)
class Seq:
    """One sequence the scheduler holds: its ids, and how many of them have KV in the cache."""

    seq_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    rank: int = 2  # class rank: 0 realtime, 1 high, 2 normal, 3 batch (lower is more urgent)
    stop_ids: frozenset[int] = frozenset()
    arrival: int = -1  # order of arrival; set by `Scheduler.add` when left at -1
    output: list[int] = field(default_factory=list)
    state: SeqState = SeqState.WAITING
    computed: int = 0  # leading ids whose keys and values are in the cache
    preemptions: int = 0
    reuse: bool = True  # may start from cached blocks; False: every id is computed (echo's logprobs)

    @property
    def ids(self) -> tuple[int, ...]:
        return self.prompt + tuple(self.output)

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def remaining(self) -> int:
        """Ids still to compute before the next token can be sampled."""
        return self.length - self.computed

    @property
    def order(self) -> tuple[int, int]:
        """Sort key, most urgent first: class rank, then arrival."""
        return (self.rank, self.arrival)


@dataclass(frozen=True)
class Row:
    """One sequence's share of a step: ids `tokens` at positions [start, start + len(tokens)).

    `table` is its whole block table (the step reads its keys and values from it); position p is
    slot `table[p // block_size] * block_size + p % block_size`. `samples`: the row's last token
    is the sequence's last id, so the step gives its next token."""

    seq_id: str
    start: int
    tokens: tuple[int, ...]
    table: tuple[int, ...]
    samples: bool

    @property
    def stop(self) -> int:
        return self.start + len(self.tokens)

    def slots(self, block_size: int) -> list[int]:
        """The cache slots the row writes, one per token."""
        return [
            self.table[p // block_size] * block_size + p % block_size for p in range(self.start, self.stop)
        ]

    def writes(self, block_size: int) -> tuple[int, ...]:
        """The blocks the row writes."""
        return self.table[self.start // block_size : -(-self.stop // block_size)]


@dataclass(frozen=True)
class StepPlan:
    """What one step runs: decode rows (one token over a cache) then prefill chunks, in that order
    in the flat batch; and the sequences preempted while planning it (their caches are gone)."""

    step: int
    decodes: tuple[Row, ...]
    chunks: tuple[Row, ...]
    preempted: tuple[str, ...]
    block_size: int

    @property
    def rows(self) -> tuple[Row, ...]:
        return self.decodes + self.chunks

    @property
    def num_tokens(self) -> int:
        return sum(len(r.tokens) for r in self.rows)

    def __len__(self) -> int:
        return len(self.decodes) + len(self.chunks)


@dataclass(frozen=True)
class Output:
    """A token `update` appended to its sequence, and how the sequence ended (None: it goes on)."""

    seq_id: str
    token: int
    finish_reason: str | None


@dataclass(frozen=True)
class Credit:
    """What the batcher may still send this replica: sequence slots, and KV blocks not spoken for
    by the sequences already running or waiting here (a waiting prompt counted whole)."""

    sequences: int
    blocks: int


@dataclass(frozen=True)
class SchedulerConfig:
    num_blocks: int
    block_size: int = 16  # as `app.partitions.digest.BLOCK`: the same blocks name the same prefixes
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    prefix_caching: bool = True
    max_in_flight: int = 1  # plans made and not yet updated: one per stage of the pipeline

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be at least max_num_seqs, which must be at least 1")
        if self.max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")


class Scheduler:
    """The step scheduler of one pipeline replica (see the module's docstring for its rules).

    Stage 0's worker calls `add` for each sequence the batcher sends, `schedule` before each step,
    `update` with the last stage's sampled tokens once the step has run (before the next
    `schedule`), `abort` for a cancelled job, and `credit` for what it reports to the batcher."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.pool = BlockPool(config.num_blocks, config.block_size, caching=config.prefix_caching)
        self.sequences: dict[str, Seq] = {}
        self.running: list[Seq] = []  # in admission order
        self.waiting: list[Seq] = []
        self._arrivals = itertools.count()
        self._step = 0
        self._pending: deque[StepPlan] = deque()  # planned, not yet updated, oldest first
        self._in_flight: set[str] = set()  # the sequences of those plans
        self._room = config.max_num_seqs  # rows the plan being made may still have
        # the step being planned: tokens left in its budget, its rows, the sequences it preempted
        self._budget = 0
        self._rows: dict[str, Row] = {}
        self._preempted: list[str] = []

    def add(self, seq: Seq) -> None:
        """Queue a new sequence. Refused if it could never fit the pool alone."""
        if seq.seq_id in self.sequences:
            raise ValueError(f"sequence {seq.seq_id} is already scheduled")
        if not seq.prompt or seq.max_tokens < 1:
            raise ValueError("a sequence needs a prompt and max_tokens of at least 1")
        if self.pool.blocks_for(len(seq.prompt) + seq.max_tokens) > self.pool.num_blocks:
            raise ValueError(
                f"sequence {seq.seq_id} needs more than the {self.pool.num_blocks} blocks of the KV cache"
            )
        if seq.arrival < 0:
            seq.arrival = next(self._arrivals)
        seq.state, seq.computed = SeqState.WAITING, 0
        self.sequences[seq.seq_id] = seq
        self.waiting.append(seq)

    def abort(self, seq_id: str) -> None:
        """End a sequence now (a cancelled job): its blocks go back, it leaves every queue."""
        seq = self.sequences.get(seq_id)
        if seq is not None:
            self._finish(seq, SeqState.FINISHED_ABORTED)

    def credit(self) -> Credit:
        """What the batcher may still send this replica (see `Credit`)."""
        held = len(self.running) + len(self.waiting)
        promised = sum(prompt_blocks(s.length, self.pool.block_size) for s in self.waiting)
        return Credit(
            sequences=max(0, self.config.max_num_seqs - held),
            blocks=max(0, self.pool.free_blocks - promised),
        )

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def in_flight(self) -> int:
        """Plans made and not yet updated."""
        return len(self._pending)

    @property
    def idle_sequences(self) -> int:
        """Sequences held here that no plan in flight holds: what a new plan may take."""
        return sum(1 for s in self.sequences.values() if s.seq_id not in self._in_flight)

    def schedule(self, max_seqs: int | None = None) -> StepPlan:
        """Plan the next step (the rules of the module's docstring), of at most `max_seqs` rows when
        given. Blocks are taken for every row. A plan without rows is not in flight: it needs no
        `update`."""
        if len(self._pending) >= self.config.max_in_flight:
            raise RuntimeError(f"step {self._pending[0].step} was planned and not updated")
        self._budget = self.config.max_num_batched_tokens
        self._rows, self._preempted = {}, []
        self._room = self.config.max_num_seqs if max_seqs is None else max(1, max_seqs)
        self._admit_urgent()
        free = [s for s in self.running if s.seq_id not in self._in_flight]
        decoding = [s for s in free if s.remaining == 1 and s.computed > 0]
        for seq in sorted(decoding, key=lambda s: s.order):
            if seq.state is SeqState.RUNNING and len(self._rows) < self._room:  # not preempted meanwhile
                self._run(seq, 1)
        prefilling = [s for s in free if s.seq_id not in self._rows]
        for seq in sorted(prefilling, key=lambda s: s.order):
            if self._budget and seq.state is SeqState.RUNNING and len(self._rows) < self._room:
                self._run(seq, min(seq.remaining, self._budget))
        if not self._preempted:  # else the pool is short: admitting more would preempt again
            for seq in sorted(self._waiting_free(), key=lambda s: s.order):
                if (
                    not self._budget
                    or len(self.running) >= self.config.max_num_seqs
                    or len(self._rows) >= self._room
                    or not self._admit(seq)
                ):
                    break
                self._run(seq, min(seq.remaining, self._budget))
        rows = list(self._rows.values())
        plan = StepPlan(
            step=self._step,
            decodes=tuple(r for r in rows if len(r.tokens) == 1 and r.start > 0 and r.samples),
            chunks=tuple(r for r in rows if not (len(r.tokens) == 1 and r.start > 0 and r.samples)),
            preempted=tuple(self._preempted),
            block_size=self.config.block_size,
        )
        if rows:
            self._step += 1
            self._pending.append(plan)
            self._in_flight.update(self._rows)
        return plan

    def update(self, plan: StepPlan, sampled: Mapping[str, int]) -> list[Output]:
        """Apply a step's outcome: every row's ids are computed now, a sampling row's token
        (`sampled[seq_id]`, one for each and only for those rows) is appended, and the sequences
        that ended (a stop id, `max_tokens`) finish and free their blocks. Rows of sequences aborted
        since the plan are skipped."""
        sampling = {r.seq_id for r in plan.rows if r.samples}
        if set(sampled) != sampling:
            raise ValueError(f"sampled tokens for {sorted(sampled)}, the step samples {sorted(sampling)}")
        if not plan.rows:
            return []  # nothing was in flight
        if not self._pending or plan is not self._pending[0]:
            raise ValueError(f"step {plan.step} is not the oldest step planned and not updated")
        self._pending.popleft()
        self._in_flight.difference_update(r.seq_id for r in plan.rows)
        outputs = []
        for row in plan.rows:
            seq = self.sequences.get(row.seq_id)
            if seq is None or seq.state is not SeqState.RUNNING:
                continue  # aborted meanwhile (and perhaps added again since: waiting, not running)
            seq.computed = row.stop
            self.pool.commit(seq.seq_id, seq.ids, seq.computed)  # before a finish frees them
            if row.samples:
                token = sampled[row.seq_id]
                seq.output.append(token)
                end = _end(seq, token)
                outputs.append(Output(seq.seq_id, token, end.finish_reason if end else None))
                if end is not None:
                    self._finish(seq, end)
        return outputs

    def _run(self, seq: Seq, tokens: int) -> None:
        """Schedule `tokens` more ids of running `seq`, preempting for blocks if need be."""
        while not self.pool.grow(seq.seq_id, seq.computed + tokens):
            victim = max((s for s in self.running if s.seq_id not in self._in_flight), key=lambda s: s.order)
            self._preempt(victim)
            if victim is seq:
                return
        self._budget -= tokens
        self._rows[seq.seq_id] = Row(
            seq_id=seq.seq_id,
            start=seq.computed,
            tokens=seq.ids[seq.computed : seq.computed + tokens],
            table=self.pool.table(seq.seq_id),
            samples=seq.computed + tokens == seq.length,
        )

    def _admit(self, seq: Seq, *, first_chunk: int | None = None) -> bool:
        """Move a waiting sequence to running with its cached blocks, if a slot and the blocks of its
        first chunk are free now; else leave it waiting."""
        hits = self._hits(seq)
        cached = len(hits) * self.config.block_size
        chunk = min(seq.length - cached, first_chunk or self._budget)
        if self.pool.needed(seq.seq_id, cached + chunk, hits) > self.pool.free_blocks:
            return False
        self.pool.take(seq.seq_id, hits)
        seq.computed = cached
        seq.state = SeqState.RUNNING
        self.waiting.remove(seq)
        self.running.append(seq)
        return True

    def _admit_urgent(self) -> None:
        """Rule 1: admit waiting sequences more urgent than a running one, preempting less urgent
        running sequences for a slot and their first chunk's blocks."""
        chunk = max(1, self.config.max_num_batched_tokens - len(self.running))  # after the decode rows
        for seq in sorted(self._waiting_free(), key=lambda s: s.order):
            if not any(s.rank > seq.rank for s in self.running):
                return  # neither it nor any after it is more urgent than a running sequence
            while not (len(self.running) < self.config.max_num_seqs and self._admit(seq, first_chunk=chunk)):
                lesser = [s for s in self.running if s.rank > seq.rank and s.seq_id not in self._in_flight]
                if not lesser or not self._could_admit(seq, chunk, lesser):
                    return
                self._preempt(max(lesser, key=lambda s: s.order))

    def _could_admit(self, seq: Seq, chunk: int, lesser: list[Seq]) -> bool:
        """Whether preempting all of `lesser` would give `seq` the blocks of its first chunk (the
        blocks only they hold come free): no sequence is preempted in vain."""
        hits = self._hits(seq)
        cached = len(hits) * self.config.block_size
        needed = self.pool.needed(seq.seq_id, cached + min(seq.length - cached, chunk), hits)
        freed = {i for s in lesser for i in self.pool.table(s.seq_id) if self.pool.refs(i) == 1}
        return needed <= self.pool.free_blocks + len(freed)

    def _waiting_free(self) -> list[Seq]:
        """Waiting sequences no plan in flight holds (one aborted in flight and added again waits
        for that plan's update)."""
        return [s for s in self.waiting if s.seq_id not in self._in_flight]

    def _hits(self, seq: Seq) -> list[int]:
        return self.pool.hits(seq.ids) if seq.reuse else []

    def _preempt(self, seq: Seq) -> None:
        self.pool.free(seq.seq_id)
        row = self._rows.pop(seq.seq_id, None)
        if row is not None:
            self._budget += len(row.tokens)
        self.running.remove(seq)
        seq.state, seq.computed = SeqState.PREEMPTED, 0
        seq.preemptions += 1
        self.waiting.append(seq)
        self._preempted.append(seq.seq_id)

    def _finish(self, seq: Seq, state: SeqState) -> None:
        self.pool.free(seq.seq_id)
        for queue in (self.running, self.waiting):
            if seq in queue:
                queue.remove(seq)
        seq.state = state
        del self.sequences[seq.seq_id]


def _end(seq: Seq, token: int) -> SeqState | None:
    if token in seq.stop_ids:
        return SeqState.FINISHED_STOPPED
    if len(seq.output) >= seq.max_tokens:
        return SeqState.FINISHED_LENGTH
    return None


def drain(scheduler: Scheduler, sample: Mapping[str, Iterable[int]], steps: int = 10_000) -> list[StepPlan]:
    """Run `scheduler` until it has no work, the sampled token of each step being the next of
    `sample[seq_id]`: the plans, in order. For tests and benchmarks of the rules alone."""
    streams = {k: iter(v) for k, v in sample.items()}
    plans: list[StepPlan] = []
    for _ in range(steps):
        if not scheduler.has_work:
            return plans
        plan = scheduler.schedule()
        plans.append(plan)
        scheduler.update(plan, {r.seq_id: next(streams[r.seq_id]) for r in plan.rows if r.samples})
    raise RuntimeError(f"still working after {steps} steps")
