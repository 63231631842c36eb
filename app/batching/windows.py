"""Batch windows and buckets: pure functions of the pending jobs, the pipelines' load and the clock.

Rules (one call to `plan` per batcher wake-up):
- jobs are bucketed by (model, prompt-length bucket), so a batch pads to a bounded length;
- a pipeline takes at most `capacity` batches in flight;
- with room in the pipeline, a bucket is dispatched when it is full, when its oldest job has
  waited `max_wait_s`, or at once when the pipeline is idle (no window to wait for);
- buckets are served in order of their most urgent job (priority class, then arrival).
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Item:
    job_id: str
    model: str
    prompt_tokens: int
    priority: int  # 0 = most urgent
    arrived: float  # batcher clock (monotonic seconds)
    stream: str = ""  # where the intake entry lives, to acknowledge it
    entry_id: str = ""

    @property
    def rank(self) -> tuple[int, float]:
        return (self.priority, self.arrived)


@dataclass(frozen=True)
class Limits:
    max_batch_size: int
    max_wait_s: float
    length_buckets: tuple[int, ...]


@dataclass(frozen=True)
class Batch:
    model: str
    bucket: int
    items: tuple[Item, ...]


def length_bucket(prompt_tokens: int, bounds: Sequence[int]) -> int:
    """The smallest bound that holds the prompt; past the last bound, the next power of two."""
    i = bisect.bisect_left(bounds, prompt_tokens)
    if i < len(bounds):
        return bounds[i]
    return 1 << max(0, prompt_tokens - 1).bit_length()


def buckets(pending: Sequence[Item], limits: Limits) -> dict[tuple[str, int], list[Item]]:
    groups: dict[tuple[str, int], list[Item]] = defaultdict(list)
    for item in pending:
        groups[(item.model, length_bucket(item.prompt_tokens, limits.length_buckets))].append(item)
    for items in groups.values():
        items.sort(key=lambda it: it.rank)
    return groups


def plan(
    pending: Sequence[Item],
    *,
    inflight: Mapping[str, int],
    capacity: Mapping[str, int],
    limits: Limits,
    now: float,
) -> list[Batch]:
    """Which batches to dispatch now. Does not mutate its inputs."""
    groups = buckets(pending, limits)
    free = {model: capacity.get(model, 1) - inflight.get(model, 0) for model, _ in groups}
    idle = {model for model in free if inflight.get(model, 0) == 0}
    batches: list[Batch] = []
    for (model, bucket), items in sorted(groups.items(), key=lambda kv: kv[1][0].rank):
        while items and free[model] > 0:
            full = len(items) >= limits.max_batch_size
            waited = now - min(it.arrived for it in items) >= limits.max_wait_s
            if not (full or waited or model in idle):
                break
            take, items = items[: limits.max_batch_size], items[limits.max_batch_size :]
            batches.append(Batch(model, bucket, tuple(take)))
            free[model] -= 1
            idle.discard(model)
    return batches


def next_deadline(pending: Sequence[Item], limits: Limits) -> float | None:
    """When the earliest window closes (batcher clock), or None with nothing pending."""
    if not pending:
        return None
    return min(it.arrived for it in pending) + limits.max_wait_s
