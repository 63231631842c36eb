"""What each step-engine replica may still take, advertised to the batcher (`Keys.credit`).

A pipeline replica on the step engine (`app/workers/engine/runtime.py`) reports its scheduler's
credit whenever it changes: free sequence slots, KV blocks not spoken for by the sequences running
or waiting there, and the batches it has received lately. The batcher sends windows against the sum
over the live replicas (`app.batching.budget.Ledger`), less what it has sent that no replica has
reported receiving yet. This module is the only writer of the key family.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from app.core.jobs import text_of
from app.core.keys import Keys

log = logging.getLogger(__name__)

RECEIVED = 64  # batches a report names: the newest ones this replica received


@dataclass(frozen=True)
class ReplicaCredit:
    """One replica's report: what it may still take, and the batches it has received lately."""

    sequences: int  # free sequence slots
    blocks: int  # free KV blocks, less those its waiting prompts will take
    block_size: int  # positions a block holds
    max_sequences: int  # its sequence slots in all
    received: tuple[str, ...] = ()  # ids of the newest batches it received, at most RECEIVED

    def to_json(self) -> str:
        return json.dumps(
            {
                "sequences": self.sequences,
                "blocks": self.blocks,
                "block_size": self.block_size,
                "max_sequences": self.max_sequences,
                "received": list(self.received[-RECEIVED:]),
            }
        )

    @classmethod
    def from_json(cls, raw: str | bytes) -> ReplicaCredit:
        data = json.loads(raw)
        return cls(
            sequences=int(data["sequences"]),
            blocks=int(data["blocks"]),
            block_size=int(data["block_size"]),
            max_sequences=int(data["max_sequences"]),
            received=tuple(str(b) for b in data.get("received", ())),
        )


def publish(redis: Any, keys: Keys, model: str, worker: str, credit: ReplicaCredit, *, ttl_s: float) -> None:
    """Advertise `worker`'s credit (it serves stage 0 of `model`)."""
    pipe = redis.pipeline(transaction=False)
    pipe.hset(keys.credit(model), worker, credit.to_json())
    pipe.expire(keys.credit(model), int(10 * ttl_s))
    pipe.execute()


def withdraw(redis: Any, keys: Keys, model: str, worker: str) -> None:
    """`worker` stops serving: its credit is no longer on offer."""
    redis.hdel(keys.credit(model), worker)


def live_credits(
    redis: Any, keys: Keys, models: Iterable[str], *, since: float
) -> dict[str, list[ReplicaCredit]]:
    """The credit of each model whose every live stage-0 replica (a heartbeat since `since`) reports
    one: the models served by the step engine. A model with a live replica that reports none (the
    batch engine), or with no live replica, is left out. An unreadable report is left out too."""
    models = list(models)
    pipe = redis.pipeline(transaction=False)
    for model in models:
        pipe.zrangebyscore(keys.workers(model, 0), since, "+inf")
        pipe.hgetall(keys.credit(model))
    replies = pipe.execute()
    out: dict[str, list[ReplicaCredit]] = {}
    for n, model in enumerate(models):
        live: Sequence[Any] = replies[2 * n]
        reports = {text_of(k): v for k, v in replies[2 * n + 1].items()}
        if not live or any(text_of(w) not in reports for w in live):
            continue
        credits = []
        for worker in live:
            try:
                credits.append(ReplicaCredit.from_json(reports[text_of(worker)]))
            except (ValueError, KeyError, TypeError):
                log.warning("an unreadable credit report of %s from %s: the census decides", model, worker)
                credits = []
                break
        if credits:
            out[model] = credits
    return out
