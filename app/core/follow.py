"""Following one job's events: the loop every live channel of the API reads a job through (SSE,
WebSocket, OpenAI streaming).

The event stream is the truth; a wake-up (pub/sub, relayed by the caller's `wake`) only says "read
again", and a poll every `poll_s` covers a wake-up that was lost. The final event carries the job's
record as it ended (the store writes the final move and its event in one script, so the record read
after the event is final): a channel shows the finished job without reading it again.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

from app.core.errors import JobNotFound
from app.core.jobrecord import JobRecord
from app.core.jobs import FINAL_EVENTS
from app.core.jobstore import AsyncJobStore

# job id -> a context that holds an asyncio.Event set whenever the job has a new event
Wake = Callable[[str], AbstractAsyncContextManager[asyncio.Event]]
BATCH = 512  # entries read per round trip


@dataclass(frozen=True)
class Event:
    id: str  # the stream entry's id: a client resumes after it
    event: str
    data: dict[str, Any]
    record: JobRecord | None = None  # on the final event: the job's record as it ended


async def record_of(store: AsyncJobStore, job_id: str) -> JobRecord:
    record = await store.get(job_id)
    if record is None:
        raise JobNotFound(f"job {job_id!r} does not exist (or has expired)", job_id=job_id)
    return record


async def is_over(store: AsyncJobStore, job_id: str, after: str | None) -> bool:
    """True when the job has ended and nothing follows `after` in its stream (its final event was
    already delivered). Raises JobNotFound once the job has expired."""
    record = await record_of(store, job_id)
    if not record.status.is_finished:
        return False
    rest = await store.redis.xrange(
        store.keys.events(job_id), min=f"({after}" if after else "-", max="+", count=1
    )
    return not rest


async def follow(
    store: AsyncJobStore, job_id: str, after: str | None = None, *, wake: Wake, poll_s: float
) -> AsyncIterator[Event]:
    """The job's events after entry id `after`: the backlog first, then the live tail, until the
    final event (which carries the record) or until the job is found over with nothing left to read
    (its final event was before `after`, or its stream is gone)."""
    stream = store.keys.events(job_id)
    async with wake(job_id) as woke:
        while True:
            woke.clear()
            start = f"({after}" if after else "-"
            entries = await store.redis.xrange(stream, min=start, max="+", count=BATCH)
            for entry_id, fields in entries:
                after = entry_id.decode()
                event, data = fields[b"event"].decode(), json.loads(fields[b"data"])
                if event in FINAL_EVENTS:
                    yield Event(after, event, data, await record_of(store, job_id))
                    return
                yield Event(after, event, data)
            if not entries:
                try:
                    await asyncio.wait_for(woke.wait(), poll_s)
                except TimeoutError:
                    if await is_over(store, job_id, after):
                        return
