"""Giving the C heap's free pages back to the system (glibc's `malloc_trim`).

glibc keeps what a process frees for its next allocations and returns little of it on its own when
what is freed lies between blocks still held. A CPU stage's prefix cache frees and allocates entries
of every prompt length once it is full (the soak's stage worker grew by ~20 MiB a minute of free heap
while what it held stayed flat; one trim gave 125 MiB back). Every process that serves trims every
`TRIM_EVERY_S`: a stage worker from its heartbeat thread, the api from a task of its own (whose heap
held at most 3.3 MiB free over an 85-minute soak: a bound, not a fix of its own).
"""

from __future__ import annotations

import asyncio
import ctypes
from functools import cache
from typing import Any

TRIM_EVERY_S = 30.0


@cache
def _malloc_trim() -> Any:
    return getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc's; None under another C library


def trim_heap() -> bool:
    """Give the free pages of every arena of the C heap back to the system. False where there is no
    `malloc_trim` (another C library) or nothing went back."""
    trim = _malloc_trim()
    return trim is not None and bool(trim(0))


async def trim_heap_every(seconds: float = TRIM_EVERY_S) -> None:
    """`trim_heap` every `seconds`, off the event loop, until cancelled."""
    while True:
        await asyncio.sleep(seconds)
        await asyncio.to_thread(trim_heap)
