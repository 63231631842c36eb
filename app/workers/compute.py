"""The compute thread: the one thread of a stage worker that runs the model.

A stage worker receives work on several threads: Celery's task threads (prefills, from the shared
stage queue) and the lane thread (decode steps). Running the model on whichever thread received the
message is slow on a CPU: torch's OpenMP runtime keeps a team of helper threads for every thread
that has run a parallel region, and once the main thread (which loaded the weights) and the
receiving threads each have one, the cores are oversubscribed by waiting helpers and every step runs
longer (`python -m bench.threads`: a decode step of 32 sequences 1.71× as long as on one thread).
So the weights are loaded, warmed up and run on this thread alone, and the receiving threads hand it
their work and wait for the outcome.

The queue is also the scheduling point between the two kinds of work. Work runs one item at a
time, in arrival order, so a waiting prefill is not starved by the lane thread coming straight back
with its next decode step; urgent work (a realtime or high prefill) goes before every waiting
ordinary item: its wait is the step in progress, not the decode steps queued behind it.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(order=True)
class _Work:
    rank: int  # 0 urgent, 1 ordinary
    ticket: int  # arrival order within a rank
    fn: Callable[[], Any] = field(compare=False)
    done: threading.Event = field(compare=False, default_factory=threading.Event)
    result: Any = field(compare=False, default=None)
    error: BaseException | None = field(compare=False, default=None)


class ComputeThread(threading.Thread):
    """Runs the callables handed to `call`, one at a time, urgent ones first."""

    def __init__(self, name: str = "compute") -> None:
        super().__init__(name=name, daemon=True)
        self._ready = threading.Condition()
        self._tickets = itertools.count()
        self._waiting: list[_Work] = []
        self._stopping = False

    def call(self, fn: Callable[[], T], *, urgent: bool = False) -> T:
        """Run `fn` on the compute thread and return what it returns (or raise what it raises)."""
        if threading.current_thread() is self:
            return fn()  # already on it: queueing behind ourselves would never return
        work = _Work(0 if urgent else 1, next(self._tickets), fn)
        with self._ready:
            if self._stopping:
                raise RuntimeError("the compute thread has stopped")
            heapq.heappush(self._waiting, work)
            self._ready.notify()
        work.done.wait()
        if work.error is not None:
            raise work.error
        return work.result  # type: ignore[no-any-return]

    def run(self) -> None:
        while True:
            with self._ready:
                self._ready.wait_for(lambda: self._waiting or self._stopping)
                if not self._waiting:
                    return  # stopping, and nothing left to run
                work = heapq.heappop(self._waiting)
            try:
                work.result = work.fn()
            except BaseException as exc:  # handed back to the caller, which decides
                work.error = exc
            work.done.set()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Run what is already queued, then end the thread; later calls raise."""
        with self._ready:
            self._stopping = True
            self._ready.notify()
        if self.is_alive():
            self.join(timeout_s)
