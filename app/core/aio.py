"""Stopping an asyncio task for certain.

One `task.cancel()` is not enough on Python 3.11: a cancel that lands as an awaited
`asyncio.wait_for` finishes is lost (wait_for returns the result and the task runs on, still
"cancelling"), and redis-py awaits connects and command writes through wait_for. A loop that talks
to Redis, such as the event hub's listener, can therefore swallow the one cancel its owner sends and
run forever, and the owner's `await task` never returns. `stop` cancels again until the task ends.
"""

from __future__ import annotations

import asyncio
from typing import Any

RECANCEL_S = 0.2  # a cancel that was lost is sent again this often


async def stop(task: asyncio.Future[Any]) -> None:
    """Cancel `task` and return once it has ended, however it ends; its outcome stays on the task
    (its exception is marked retrieved, so an error the caller does not read is not logged). A
    caller cancelled while it waits cancels the task once more and goes on being cancelled."""
    try:
        while not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=RECANCEL_S)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not task.cancelled():
        task.exception()
