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
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from app.core.jobs import text_of
from app.core.keys import Keys

log = logging.getLogger(__name__)

RECEIVED = 64  # batches a report names: the newest ones this replica received


def prompt_blocks(prompt_tokens: int, block_size: int) -> int:
    """The KV blocks a replica's credit counts a waiting prompt for: the prompt and its first token.
    The replica's scheduler promises them (`Scheduler.credit`), the batcher sends against them."""
    return -(-(prompt_tokens + 1) // block_size)


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


class Advertiser:
    """Publishes one stage-0 worker's credit (`ReplicaCredit`) for the batcher. Now and then it also
    drops the reports of workers its stage's heartbeats have forgotten (a worker killed before it
    could withdraw its own), so the hash holds the workers of the last 10 x heartbeat_ttl_s."""

    TIDY_EVERY_S = 60.0

    def __init__(self, redis: Any, keys: Keys, model: str, worker: str, *, ttl_s: float) -> None:
        self.redis, self.keys, self.model, self.worker, self.ttl_s = redis, keys, model, worker, ttl_s
        self._tidied = 0.0

    def __call__(self, credit: ReplicaCredit) -> None:
        key = self.keys.credit(self.model)
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(key, self.worker, credit.to_json())
        pipe.expire(key, int(10 * self.ttl_s))
        pipe.execute()
        if time.monotonic() - self._tidied >= self.TIDY_EVERY_S:
            self._tidied = time.monotonic()
            known = {text_of(w) for w in self.redis.zrange(self.keys.workers(self.model, 0), 0, -1)}
            gone = [f for f in map(text_of, self.redis.hkeys(key)) if f not in known and f != self.worker]
            if gone:
                self.redis.hdel(key, *gone)

    def withdraw(self) -> None:
        """This worker stops serving: its credit is no longer on offer."""
        self.redis.hdel(self.keys.credit(self.model), self.worker)


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
