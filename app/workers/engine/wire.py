"""The step engine's messages between the workers of one pipeline replica (`StepMessage.plan`).

A `step` goes from stage k to stage k + 1 with the plan's hidden states: its rows (sequence,
first position, ids, block table, whether it samples), the micro-batch it belongs to (`group`: the
decode slab it reads), the cache's geometry, the sequences the last stage has not seen yet (`new`,
with the batch each came in: it reads their requests) and those stage 0 let go since its last step
(`gone`: the last stage forgets their sampling state). A `sampled` goes from the last stage back to
stage 0: the token of each sampling row, the sequences that left (finished, cancelled, failed
alone), or the error that failed the step. `epoch` names stage 0's scheduler: an answer to a plan
of a scheduler since reset is ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from app.workers.engine.scheduler import Row, StepPlan


@dataclass(frozen=True)
class PlanWire:
    """A step as it travels: the plan and what the later stages need beside it."""

    plan: StepPlan
    head: str  # stage 0's worker
    group: int
    epoch: int
    num_blocks: int
    new: dict[str, str] = field(default_factory=dict)  # sequence -> its batch
    gone: tuple[str, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        plan = self.plan
        return {
            "step": plan.step,
            "head": self.head,
            "group": self.group,
            "epoch": self.epoch,
            "num_blocks": self.num_blocks,
            "block_size": plan.block_size,
            "decodes": len(plan.decodes),
            "rows": [[r.seq_id, r.start, list(r.tokens), list(r.table), r.samples] for r in plan.rows],
            "new": dict(self.new),
            "gone": list(self.gone),
        }

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> PlanWire:
        rows = tuple(
            Row(str(seq_id), int(start), tuple(tokens), tuple(table), bool(samples))
            for seq_id, start, tokens, table, samples in wire["rows"]
        )
        decodes = int(wire["decodes"])
        plan = StepPlan(
            step=int(wire["step"]),
            decodes=rows[:decodes],
            chunks=rows[decodes:],
            preempted=(),
            block_size=int(wire["block_size"]),
        )
        return cls(
            plan,
            head=str(wire["head"]),
            group=int(wire["group"]),
            epoch=int(wire["epoch"]),
            num_blocks=int(wire["num_blocks"]),
            new={str(k): str(v) for k, v in wire.get("new", {}).items()},
            gone=tuple(wire.get("gone", ())),
        )


@dataclass(frozen=True)
class Sampled:
    """A step's outcome, from the last stage back to stage 0."""

    step: int
    epoch: int
    tokens: dict[str, int] = field(default_factory=dict)  # one per sampling row
    left: tuple[str, ...] = ()
    error: str | None = None

    def to_wire(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "epoch": self.epoch,
            "tokens": dict(self.tokens),
            "left": list(self.left),
            "error": self.error,
        }

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> Sampled:
        return cls(
            step=int(wire["step"]),
            epoch=int(wire["epoch"]),
            tokens={str(k): int(v) for k, v in wire.get("tokens", {}).items()},
            left=tuple(wire.get("left", ())),
            error=wire.get("error"),
        )
