"""The stage message (docs/architecture.md): what one stage hands to the next.

A batch is prefilled once (`kind="prefill"`, step 0), then decoded one token per step. Forward
messages carry hidden states from stage k to k+1; the last stage samples and sends the new token
ids back to stage 0 as the next `decode` step, until every sequence is done; then `release` frees
the KV caches held by the earlier stages.

Iteration-level batching: a batch that was prefilled while another one of the same pipeline was
running joins it at the next step boundary. The last stage decides; the running batch's next
decode message lists the joining batch in `merge`, and every stage appends that batch's rows to
the running batch's state when the message reaches it (it has prefilled the joiner by then).

Sequences are named by job id, in row order. A stage keeps its own per-batch state (KV cache,
attention mask) and, when a step lists fewer sequences than the previous one, keeps only those rows.
The message is plain data (msgpack); tensors are encoded by `app.partitions.codecs`.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

# "step" and "sampled" are the step engine's (app/workers/engine/runtime.py): a step's plan and
# hidden states from stage k to k + 1; the last stage's sampled tokens back to stage 0.
Kind = Literal["prefill", "decode", "release", "step", "sampled"]
STEP_TASK = "conveyor.stage.step"
EMBED_TASK = "conveyor.embed.step"  # one batch of embeddings jobs through one embeddings stage
PROTOCOL_VERSION = 1


@dataclass(frozen=True)
class StepMessage:
    batch_id: str
    model: str
    stage: int  # the stage this message is addressed to
    num_stages: int
    kind: Kind
    step: int
    seq_ids: list[str]
    tensors: dict[str, dict[str, Any]] = field(default_factory=dict)
    # routes[k]: the lane (a Redis list) of the stage-k replica that holds this batch's KV cache.
    routes: list[str | None] = field(default_factory=list)
    # Batches whose rows join this one at this step (after this batch's own rows, in order).
    merge: list[str] = field(default_factory=list)
    # The most urgent priority class among the batch's jobs (an index into PRIORITIES, 0 = realtime):
    # its prefill is fetched and run ahead of less urgent work on every stage.
    priority: int = 2
    # The step engine's plan of a "step" (its rows, micro-batch, new and gone sequences) or the
    # outcome of a "sampled" (tokens, sequences that left, an error): app/workers/engine/wire.py
    plan: dict[str, Any] = field(default_factory=dict)
    sent_at: float = 0.0
    v: int = PROTOCOL_VERSION

    def to_wire(self) -> dict[str, Any]:
        return asdict(replace(self, sent_at=time.time()))

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> StepMessage:
        if wire.get("v") != PROTOCOL_VERSION:
            raise ValueError(f"unsupported stage protocol version {wire.get('v')!r}")
        return cls(**wire)

    def forward(self, **changes: Any) -> StepMessage:
        return replace(self, **changes)

    def summary(self) -> str:
        """What monitoring (Flower, Celery's events and logs) shows of this message: its place in
        the pipeline and nothing of the jobs' data (no tensors, no token ids, no job ids)."""
        return (
            f"<{self.kind} batch {self.batch_id[:8]} step {self.step} stage {self.stage}/{self.num_stages}"
            f" {len(self.seq_ids)} seq>"
        )

    @property
    def urgent(self) -> bool:
        """A realtime or high prefill: it goes before queued decode steps and less urgent prefills."""
        return self.kind == "prefill" and self.priority < URGENT_CLASSES

    @property
    def background(self) -> bool:
        """A prefill of batch-class jobs only: it waits for every interactive prefill and decode step."""
        return self.kind == "prefill" and self.priority >= BATCH_CLASS


def embed_batch(batch_id: str, job_ids: list[str]) -> dict[str, Any]:
    """The batcher's message to embeddings stage 0: one batch of embeddings jobs, in row order (their
    texts are in their records). The stages add the plan's fingerprint, each job's row count and the
    named tensors the next piece needs (app/workers/embedding.py)."""
    return {"batch_id": batch_id, "job_ids": list(job_ids)}


# Classes 0 and 1 (realtime, high) are urgent: no batch window, a reserve slot, first in line.
URGENT_CLASSES = 2
# Class 3 (batch) runs on what the interactive classes leave: it never ages over them, the batcher
# leaves them a reserve of seats, and a stage runs its prefills after every other waiting item.
BATCH_CLASS = 3
# Broker priority of a prefill by class (kombu on Redis: 0 is fetched first, steps 0/3/6/9).
BROKER_PRIORITY = (0, 0, 3, 6)


def broker_priority(message: StepMessage) -> int:
    """The Celery message priority of a stage message: decode and release steps go first (they
    rarely travel through the broker), prefills by their batch's most urgent class."""
    if message.kind != "prefill":
        return 0
    return BROKER_PRIORITY[min(max(message.priority, 0), len(BROKER_PRIORITY) - 1)]
