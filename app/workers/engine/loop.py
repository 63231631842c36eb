"""The engine loop of one pipeline replica whose stages share a process: plan, run, sample, update.

Each step: the scheduler plans (`Scheduler.schedule`), the plan's rows become one flat batch of
token ids and one layout (`paged.Ragged`), every stage runs it over its own layers and paged cache
(`app.partitions.ragged.forward`), the last stage's logits of the sampling rows are turned into
tokens by the caller's `choose`, and the scheduler takes them back (`Scheduler.update`). Nothing is
padded, nothing moves when a sequence joins, leaves or is preempted, and a long prompt is cut into
chunks that share steps with the running sequences' decode rows.

It is the loop the stage worker's executor runs for a pipeline in one worker, and the harness the
scheduler's rules are tested through on real models (`tests/unit/test_engine_loop.py`). Stage 0's
worker of a pipeline of several workers holds a loop of its own stage only (`run_stage`): the
later stages run the plan's step in their own processes (`app.workers.engine.runtime`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from app.partitions import ragged
from app.partitions.layers import StagePartition
from app.partitions.paged import Ragged
from app.workers.engine.scheduler import Output, Scheduler, SchedulerConfig, Seq, StepPlan

# The sampling rows' sequence ids and their logits [R, V] -> one token per row.
Choose = Callable[[Sequence[str], torch.Tensor], Sequence[int]]


def greedy(seq_ids: Sequence[str], logits: torch.Tensor) -> list[int]:
    return logits.argmax(-1).tolist()  # type: ignore[no-any-return]


def layout(plan: StepPlan, device: torch.device | str = "cpu") -> tuple[Ragged, torch.Tensor, list[int]]:
    """A plan's step layout, its token ids [T] (flat, row after row), and the flat index of each
    sampling row's last token, in row order."""
    rows = plan.rows
    step = Ragged.build(
        [len(r.tokens) for r in rows],
        [r.stop for r in rows],
        [r.table for r in rows],
        plan.block_size,
        device,
        seq_ids=[r.seq_id for r in rows],
    )
    ids = torch.tensor([t for r in rows for t in r.tokens], dtype=torch.long)
    sample, end = [], 0
    for r in rows:
        end += len(r.tokens)
        if r.samples:
            sample.append(end - 1)
    return step, ids, sample


@dataclass
class StepResult:
    plan: StepPlan
    outputs: list[Output]
    logits: dict[str, torch.Tensor]  # each sampling row's next-token logits [V]


class EngineLoop:
    """The stages of one pipeline in this process, their paged caches, and their scheduler."""

    def __init__(self, stages: Sequence[StagePartition], config: SchedulerConfig) -> None:
        if not stages or not stages[0].is_first:
            raise ValueError("an engine loop starts at its pipeline's first stage")
        for stage in stages:
            ragged.check(stage)
        self.stages = list(stages)
        self.scheduler = Scheduler(config)
        self.caches = [ragged.cache_for(s, config.num_blocks, config.block_size) for s in stages]
        self.rules = [ragged.layer_rules(s) for s in stages]

    def reset(self) -> None:
        """Forget every sequence and plan (after a step that raised): a fresh scheduler over the same
        caches, whose contents no block table names any more."""
        self.scheduler = Scheduler(self.scheduler.config)
        for cache in self.caches:
            cache.reset_slabs()

    def add(self, seq: Seq) -> None:
        self.scheduler.add(seq)

    def abort(self, seq_id: str) -> None:
        self.scheduler.abort(seq_id)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @property
    def whole(self) -> bool:
        """Whether this loop holds its pipeline's last stage too."""
        return self.stages[-1].is_last

    def run(self, plan: StepPlan, final: list[torch.Tensor] | None = None, group: int = 0) -> torch.Tensor:
        """Run a plan through every stage held here: on a whole pipeline, the sampling rows' logits
        [R, V] in row order (and the last stage's final hidden states [T, D] appended to `final`,
        when given); else the hidden states [T, D] the next stage takes."""
        step, x, sample = layout(plan, self.stages[0].device)
        for k in range(len(self.stages)):
            x = self.run_stage(k, step, x, sample, final=final, group=group)
        return x

    def run_stage(
        self,
        k: int,
        step: Ragged,
        x: torch.Tensor,
        sample: Sequence[int],
        *,
        final: list[torch.Tensor] | None = None,
        group: int = 0,
    ) -> torch.Tensor:
        """Run stage `k` held here over a step's layout (of micro-batch `group`)."""
        stage, cache, rules = self.stages[k], self.caches[k], self.rules[k]
        return ragged.forward(stage, cache, step, x, rules=rules, sample=sample, final=final, group=group)

    def step(self, choose: Choose = greedy) -> StepResult:
        """Plan, run and apply one step (a whole pipeline's loop)."""
        plan = self.scheduler.schedule()
        sampling = [r.seq_id for r in plan.rows if r.samples]
        logits = self.run(plan) if plan.rows else torch.zeros(0)
        tokens = list(choose(sampling, logits)) if sampling else []
        outputs = self.scheduler.update(plan, dict(zip(sampling, tokens, strict=True)))
        return StepResult(plan, outputs, dict(zip(sampling, logits, strict=False)))
