"""Open event streams per tenant: one tenant cannot hold every connection and task of the API.

Every follower of a job's events (SSE on `/v1/jobs/{id}/events`, `stream: true` on `/v1/inference`
and the OpenAI routes, the WebSocket) takes a slot of its tenant for as long as it streams; past
`CONVEYOR_TENANT_MAX_STREAMS` open at once in this API process the next is refused with 429
`too_many_streams` (a WebSocket closes with 4429), before any job is submitted. Counted per API
process, like the connections themselves: with N replicas a tenant may hold N times the cap.

A slot is given back when its stream ends (the events generator's `finally`), and, should the
stream never start (the client left before the response began), when the slot is collected.
"""

from __future__ import annotations

import weakref
from collections import Counter

from app.core import metrics
from app.core.errors import TooManyStreams

SSE_PING_S = 15  # a comment line this often keeps proxies from closing an idle event stream


class Slot:
    """One open stream of one tenant; `release()` gives it back (once; later calls do nothing)."""

    def __init__(self, slots: StreamSlots, tenant: str) -> None:
        self.tenant = tenant
        self.release = weakref.finalize(self, slots._give_back, tenant)


class StreamSlots:
    def __init__(self, limit: int) -> None:
        self.limit = limit  # 0: no cap
        self.open: Counter[str] = Counter()

    def take(self, tenant: str) -> Slot:
        if self.limit and self.open[tenant] >= self.limit:
            metrics.STREAMS_REFUSED.inc()
            raise TooManyStreams(
                f"tenant {tenant!r} already has {self.open[tenant]} event streams open "
                f"(CONVEYOR_TENANT_MAX_STREAMS={self.limit}); close one, or poll the job",
                retry_after_s=1,
                limit=self.limit,
            )
        self.open[tenant] += 1
        return Slot(self, tenant)

    def _give_back(self, tenant: str) -> None:
        self.open[tenant] -= 1
        if self.open[tenant] <= 0:
            del self.open[tenant]
