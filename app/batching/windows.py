"""Batch windows and buckets: pure functions of the pending jobs, the pipelines' load and the clock.

Rules (one call to `plan` per batcher wake-up):
- jobs are bucketed by (model, prompt-length bucket), so a batch pads to a bounded length;
- a pipeline takes at most `capacity` batches in flight;
- with room in the pipeline, a bucket is dispatched when it is full, when its oldest job has
  waited `max_wait_s`, or at once when the pipeline is idle (no window to wait for) and the bucket
  holds `min_batch_size` jobs (1: any job; more makes an idle pipeline gather a batch too, up to
  the window);
- buckets are served in order of their most urgent job: its effective priority class, then its
  tenant's fair-share tag (app/batching/fairshare.py), then its arrival. A job's effective class is
  its class minus one per whole `aging_s` seconds waited, so a job of an interactive class c
  (realtime, high, normal) waits behind newer work for at most c x aging_s (nothing starves). The
  `batch` class does not age: it runs on what the interactive classes leave, so however long a batch
  line has waited, a fresh interactive job goes before it. Within a class, tenants that are all waiting take
  turns by weight, whatever their backlogs; one tenant alone is served in arrival order;
- a job that was recovered more than once (it may be what kills workers) runs alone, so a poison
  pill takes no batch-mates down with it;
- the batch class leaves `reserve` seats of a pipeline's room to the interactive classes: an
  interactive job never waits for batch lines to finish before it has a seat (the batch class still
  takes every seat beyond that, and has the pipeline when nothing else is waiting);
- a job still waiting at its deadline is not dispatched: `expired` names it;
- a bucket led by a realtime or high job goes at once, without waiting for its window or its
  `min_batch_size`, and may take as many batch slots again as the pipeline has (its prefills are
  fetched and run first);
- with `max_prefill_tokens`, a batch holds at most that many prompt positions (its size times its
  longest prompt): one prefill is the longest a stage makes the decode steps and an urgent prefill
  wait, so it is bounded (what vLLM calls max_num_batched_tokens); not on the step engine, which
  runs prompts in chunks of its own;
- a pipeline on the step engine takes a batch against its KV blocks too (`kv`): a window takes the
  head of its jobs whose prompts fit the blocks free there; an urgent job goes beyond (its
  replica preempts less urgent sequences for it), and a prompt larger than the whole free cache
  goes alone to an idle pipeline, whose replica refuses it with its reason rather than the job
  waiting here forever.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from app.batching import fairshare
from app.core.credit import prompt_blocks
from app.core.protocol import BATCH_CLASS, URGENT_CLASSES

URGENT = URGENT_CLASSES  # realtime and high: no window, and a reserve beyond the pipeline's bounds
BATCH = BATCH_CLASS  # the batch class: served with what the interactive classes leave
UNBOUNDED = 1 << 30


@dataclass(frozen=True)
class Item:
    job_id: str
    model: str
    prompt_tokens: int
    priority: int  # 0 = most urgent
    arrived: float  # batcher clock (monotonic seconds)
    stream: str = ""  # where the intake entry lives, to acknowledge it
    entry_id: str = ""
    deadline: float | None = None  # batcher clock: must have started by then, else it expires
    alone: bool = False  # recovered more than once: dispatched in a batch of its own
    tenant: str = ""  # who submitted it: fair share is across tenants
    max_tokens: int = 0  # what it may generate (0 for a recovered job: it was charged once)
    kind: str | None = None  # the job's, where it is not a generation (`app.core.discovery.EMBEDDING`)

    @property
    def cost(self) -> int:
        """What the job may hold of its pipeline, in tokens: what fair share charges its tenant."""
        return self.prompt_tokens + self.max_tokens

    def level(self, now: float, aging_s: float) -> int:
        """Its effective class, had it its own age (`ranking` deals ages out by fair share)."""
        return effective_class(self.priority, now - self.arrived, aging_s)


def effective_class(priority: int, waited: float, aging_s: float) -> int:
    """One class up per whole aging_s waited, realtime (0) at most; the batch class stays the batch
    class (aging orders the interactive classes, it never lifts batch work over them)."""
    if priority >= BATCH:
        return priority
    aged = math.floor(max(waited, 0.0) / aging_s) if aging_s > 0 else 0
    return max(priority - aged, 0)


Rank = Callable[[Item], tuple[float, ...]]


def ranking(
    pending: Sequence[Item],
    limits: Limits,
    now: float,
    share: fairshare.Share | None = None,
    weights: Mapping[str, float] | None = None,
) -> Rank:
    """The order jobs are served in: effective class, then age, then fair-share turn, then arrival.

    Aging and fair share meet here. Within one class the tenants take turns (fairshare.tags); the
    class's ages are then dealt out in that order: its oldest age goes to the job whose turn is first,
    the next to the second, and so on. A class thus ages as a whole exactly as in arrival order
    (against other classes nothing changes), while the age of one tenant's deep backlog cannot lift
    it over another tenant's newer jobs of the same class."""
    tags = fairshare.tags(pending, share or {}, weights or {}, order=lambda it: (it.priority, it.arrived))
    by_class: dict[int, list[Item]] = defaultdict(list)
    for it in pending:
        by_class[it.priority].append(it)
    age: dict[int, float] = {}  # id(item) -> the arrival time whose age it carries
    for items in by_class.values():
        turns = sorted(items, key=lambda it: (tags[id(it)], it.arrived))
        for it, arrived in zip(turns, sorted(it.arrived for it in items), strict=True):
            age[id(it)] = arrived

    def rank(it: Item) -> tuple[float, ...]:
        arrived = age[id(it)]
        return (
            effective_class(it.priority, now - arrived, limits.aging_s),
            arrived,
            tags[id(it)],
            it.arrived,
        )

    return rank


# Prompt-length bucket bounds (tokens): a batch pads to its longest prompt, buckets bound the waste.
# Powers of two from 64, as `length_bucket` goes on past the last one.
LENGTH_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)


@dataclass(frozen=True)
class Limits:
    max_batch_size: int
    max_wait_s: float
    length_buckets: tuple[int, ...]
    aging_s: float = 30.0
    max_prefill_tokens: int | None = None  # prompt positions (size x longest prompt) per batch
    min_batch_size: int = 1  # an idle pipeline still waits for this many jobs (or the window)


@dataclass(frozen=True)
class Batch:
    model: str
    bucket: int
    items: tuple[Item, ...]

    @property
    def priority(self) -> int:
        """The most urgent class among its jobs."""
        return min(it.priority for it in self.items)

    @property
    def kind(self) -> str | None:
        """Its jobs' kind: one model's jobs are all of one kind, so a batch is too."""
        kinds = {it.kind for it in self.items}
        if len(kinds) != 1:
            raise ValueError(f"a batch of {self.model} mixes job kinds {sorted(map(str, kinds))}")
        return kinds.pop()


def length_bucket(prompt_tokens: int, bounds: Sequence[int]) -> int:
    """The smallest bound that holds the prompt; past the last bound, the next power of two."""
    i = bisect.bisect_left(bounds, prompt_tokens)
    if i < len(bounds):
        return bounds[i]
    return 1 << max(0, prompt_tokens - 1).bit_length()


def buckets(pending: Sequence[Item], limits: Limits, rank: Rank) -> dict[tuple[str, int], list[Item]]:
    groups: dict[tuple[str, int], list[Item]] = defaultdict(list)
    for item in pending:
        groups[(item.model, length_bucket(item.prompt_tokens, limits.length_buckets))].append(item)
    for items in groups.values():
        items.sort(key=rank)
    return groups


def expired(pending: Sequence[Item], now: float) -> list[Item]:
    """Jobs whose deadline to start has passed: they end `expired` instead of running."""
    return [it for it in pending if it.deadline is not None and now >= it.deadline]


def plan(
    pending: Sequence[Item],
    *,
    inflight: Mapping[str, int],
    capacity: Mapping[str, int],
    limits: Limits,
    now: float,
    room: Mapping[str, int] | None = None,
    running: Mapping[str, int] | None = None,
    hold: Collection[str] = (),
    share: fairshare.Share | None = None,
    weights: Mapping[str, float] | None = None,
    reserve: Mapping[str, int] | None = None,
    kv: Mapping[str, tuple[int, int]] | None = None,
) -> list[Batch]:
    """Which batches to dispatch now. Does not mutate its inputs (expired jobs are left out).

    `inflight`/`capacity`: batches in flight (with continuous batching: being prefilled) and how
    many a pipeline takes; `room`: sequences a pipeline may still start (None: no such bound);
    `running`: sequences in flight — a pipeline is idle (no window to wait for) only with none.
    `hold`: models with an urgent batch dispatched and not started yet; their urgent jobs wait for it
    to start and then go together (a stage runs prefills one at a time, so one prefill of several
    jobs ends sooner than several prefills of one job each, with decode steps in between).
    realtime and high may use as many batch slots again and one batch of sequences beyond the
    budget, so a saturated pipeline still starts them within a step.
    `share`/`weights`: the tenants' virtual times (fairshare.settle) and weights; None: one tenant.
    `reserve`: seats of a pipeline's `room` the batch class leaves free for the interactive classes.
    `kv`: a step-engine pipeline's free KV blocks and its block size (the module's docstring).
    """
    late = {id(it) for it in expired(pending, now)}
    live = [it for it in pending if id(it) not in late]
    rank = ranking(live, limits, now, share, weights)
    shared = buckets([it for it in live if not it.alone], limits, rank)
    groups = [(model, bucket, items) for (model, bucket), items in shared.items()]
    groups += [
        (it.model, length_bucket(it.prompt_tokens, limits.length_buckets), [it]) for it in live if it.alone
    ]
    free = {model: capacity.get(model, 1) - inflight.get(model, 0) for model, _, _ in groups}
    seats = {model: (room or {}).get(model, UNBOUNDED) for model, _, _ in groups}
    idle = {m for m in free if inflight.get(m, 0) == 0 and (running or {}).get(m, 0) == 0}
    blocks = {model: free_blocks for model, (free_blocks, _) in (kv or {}).items()}
    batches: list[Batch] = []
    for model, bucket, items in sorted(groups, key=lambda g: rank(g[2][0])):
        while items:
            urgent = items[0].priority < URGENT
            slots = capacity.get(model, 1) if urgent else 0  # the urgent classes' reserve
            size = min(limits.max_batch_size, seats[model] + (limits.max_batch_size if urgent else 0))
            if free[model] + slots <= 0 or size <= 0:
                break
            # realtime and high do not wait for a window to fill: latency is what they pay for
            full = len(items) >= limits.max_batch_size or items[0].alone or (urgent and model not in hold)
            if urgent and model in hold and not full:
                break
            waited = now - min(it.arrived for it in items) >= limits.max_wait_s
            gathered = model in idle and len(items) >= limits.min_batch_size
            if not (full or waited or gathered):
                break
            size = 1 if items[0].alone else size
            # a step-engine pipeline chunks prompts itself: its KV blocks bound a batch instead
            take = items[:size] if model in blocks else within_tokens(items[:size], limits.max_prefill_tokens)
            if urgent and (free[model] <= 0 or seats[model] < len(take)):  # on the reserve: urgent only
                take = [it for it in take if it.priority < URGENT]
            # batch lines rank after every interactive job: they fill only the seats beyond the reserve
            interactive = sum(it.priority < BATCH for it in take)
            spare = seats[model] - interactive - (reserve or {}).get(model, 0)
            take = take[: interactive + max(spare, 0)]
            if model in blocks:
                block_size = (kv or {})[model][1]
                take = within_blocks(take, blocks[model], block_size, alone=model in idle)
                blocks[model] -= sum(prompt_blocks(it.prompt_tokens, block_size) for it in take)
            if not take:
                break
            chosen = {id(it) for it in take}
            items = [it for it in items if id(it) not in chosen]
            batches.append(Batch(model, bucket, tuple(take)))
            free[model] -= 1
            seats[model] -= len(take)
            idle.discard(model)
    return batches


def batch_reserve(sequences: int, limits: Limits) -> int:
    """The seats of a pipeline's sequence budget that the batch class leaves to the interactive classes:
    one batch (`max_batch_size`), half the budget at most, so batch work still runs on a small one.
    Batched decoding gains little past one batch on a CPU, so the batch class loses little by it."""
    return min(limits.max_batch_size, sequences // 2)


def within_tokens(items: Sequence[Item], max_tokens: int | None) -> list[Item]:
    """The longest head of `items` whose padded prefill (count x longest prompt) fits `max_tokens`;
    at least one item, whatever its length."""
    if max_tokens is None:
        return list(items)
    longest = 0
    for n, it in enumerate(items):
        longest = max(longest, it.prompt_tokens)
        if n and (n + 1) * longest > max_tokens:
            return list(items[:n])
    return list(items)


def within_blocks(items: Sequence[Item], free: int, block_size: int, *, alone: bool) -> list[Item]:
    """The head of `items` whose prompts fit `free` KV blocks, urgent jobs counted but never held
    back; with `alone` (an idle pipeline) at least the first job, whatever its prompt."""
    taken: list[Item] = []
    for it in items:
        need = prompt_blocks(it.prompt_tokens, block_size)
        if need > free and it.priority >= URGENT and not (alone and not taken):
            break
        taken.append(it)
        free -= need
    return taken


def next_deadline(pending: Sequence[Item], limits: Limits) -> float | None:
    """When the earliest window closes or deadline passes (batcher clock), None with nothing pending."""
    if not pending:
        return None
    deadlines = [it.deadline for it in pending if it.deadline is not None]
    return min([min(it.arrived for it in pending) + limits.max_wait_s, *deadlines])
