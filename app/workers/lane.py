"""The direct lane: a running batch's hand-offs between the replicas that hold its KV cache.

Celery carries what any replica of a stage may take: a new batch's prefill, load-balanced over
the stage's shared queue, acknowledged late, visible in Flower. Once a batch is prefilled its KV
cache lives in one process per stage, so every later message of that batch (decode steps, joins,
release) can only be served by that process. Those go over the lane: one plain Redis list per
worker process, LPUSH by the sender, BRPOP by a thread of the owner. This halves a decode hop's
latency (`bench/hop.py` at commit 57abc94): no task envelope, no unacked-index bookkeeping, no
result machinery.

At-most-once is the right guarantee here: a decode step is worthless without the KV cache of the
process it is addressed to, so redelivering it elsewhere could not help. If that process dies, its
batch is rescheduled from the job records (the recovery path), not from its lane.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import msgpack

log = logging.getLogger(__name__)

POLL_S = 1.0  # BRPOP timeout: how soon a stopping consumer notices
LANE_TTL_S = 3600  # a lane left behind by a dead worker disappears on its own


def send(redis: Any, lane: str, wire: dict[str, Any], ttl_s: int = LANE_TTL_S) -> None:
    """Put one message on a worker's lane (one round trip)."""
    pipe = redis.pipeline(transaction=False)
    pipe.lpush(lane, msgpack.packb(wire, use_bin_type=True))
    pipe.expire(lane, ttl_s)
    pipe.execute()


class LaneConsumer(threading.Thread):
    """Pops this worker's lane and hands each message to `handle`, one at a time.

    `handle` is called on this thread; the stage worker's handler passes the message to its compute
    thread (`app.workers.compute`), which runs the Celery task's messages too. A message that cannot
    be decoded is logged and dropped; Redis going away is retried with backoff.
    """

    def __init__(
        self, redis: Any, lane: str, handle: Callable[[dict[str, Any]], None], *, poll_s: float = POLL_S
    ) -> None:
        """`poll_s`: the BRPOP timeout, how long `stop` may wait (tests that stop often shorten it)."""
        super().__init__(name="lane", daemon=True)
        self.poll_s = poll_s
        self.redis = redis
        self.lane = lane
        self.handle = handle
        self._stopping = threading.Event()

    def run(self) -> None:
        backoff = 0.1
        while not self._stopping.is_set():
            try:
                popped = self.redis.brpop([self.lane], timeout=self.poll_s)
            except Exception:
                log.warning(
                    "lane %s: Redis unreachable, retrying in %.1f s", self.lane, backoff, exc_info=True
                )
                self._stopping.wait(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            backoff = 0.1
            if popped is None:
                continue
            try:
                wire = msgpack.unpackb(popped[1], raw=False)
            except Exception:
                log.exception("lane %s: dropped a message that is not msgpack", self.lane)
                continue
            try:
                self.handle(wire)
            except Exception:  # the handler has its own error boundary; this keeps the thread alive
                log.exception("lane %s: handler failed", self.lane)

    def stop(self, timeout_s: float | None = None) -> None:
        """Stop popping, wait for the message in hand (by default up to a poll and a second), and
        delete the lane (nobody will read it)."""
        self._stopping.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(self.poll_s + 1.0 if timeout_s is None else timeout_s)
        try:
            self.redis.delete(self.lane)
        except Exception:
            log.debug("could not delete lane %s", self.lane, exc_info=True)
