"""The compute thread: the one thread of a stage worker that runs the model.

A stage worker receives work on several threads: Celery's task threads (prefills, from the shared
stage queue) and the lane thread (decode steps). Running the model on whichever thread received the
message is slow on a CPU: torch's OpenMP runtime keeps a team of helper threads for every thread
that has run a parallel region, and with teams for the main thread (which loaded the weights) and
for the receiving threads, steps ran longer on the same cores (`bench/threads.py` at commit 57abc94:
a decode step of 32 sequences 1.71× as long as on one thread).
So the weights are loaded, warmed up and run on this thread alone, and the receiving threads hand it
their work and wait for the outcome.

The queue is also the scheduling point between the two kinds of work. Work runs one item at a
time, in arrival order, so a waiting prefill is not starved by the lane thread coming straight back
with its next decode step; urgent work (a realtime or high prefill) goes before every waiting
ordinary item. A background item (a prefill of batch-class jobs only) takes its place as if it had
arrived BACKGROUND_LAG items later: an interactive prefill or decode step goes before the batch
lines' prefills queued ahead of it, and a background item still runs after at most that many
others (it is not starved). An urgent item does not even wait for the step in progress: an item
may be a generator of steps (`StageRuntime.run` suspends after every layer), and between two of
an ordinary item's steps this thread's one loop runs the urgent items waiting, each whole, then
resumes the suspended step where it was (its batch's state is its own). An urgent job's wait for
the stage is one layer of the step in progress, not a whole decode step or a long prefill. Nothing
runs inside anything else: the loop alone decides what runs next.

Each item, and each step of an item, runs on the torch thread count its `Threads` gives
(`app.workers.threads`): the worker's share of the host, widened while the host's other CPUs idle.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from app.core.steps import complete
from app.workers.threads import Threads, apply

T = TypeVar("T")
# A background item waits as if it had arrived this many items later: past the interactive prefill
# and decode step that come in meanwhile, never longer. Kept small: a background item waiting here
# holds a task thread, and with every task thread held a later prefill waits in the stage queue.
BACKGROUND_LAG = 2


@dataclass(order=True)
class _Work:
    rank: int  # 0 urgent, 1 ordinary (background items too, their ticket pushed back)
    ticket: int  # arrival order within a rank
    background: bool  # on a tie of tickets, the background item goes second
    fn: Callable[[], Any] = field(compare=False)
    done: threading.Event = field(compare=False, default_factory=threading.Event)
    result: Any = field(compare=False, default=None)
    error: BaseException | None = field(compare=False, default=None)


class ComputeThread(threading.Thread):
    """Runs the callables handed to `call`, one at a time, urgent ones first."""

    def __init__(self, name: str = "compute", threads: Threads | None = None) -> None:
        super().__init__(name=name, daemon=True)
        self.threads = threads  # the torch threads each item (and each step of one) runs on
        self._ready = threading.Condition()
        self._tickets = itertools.count()
        self._waiting: list[_Work] = []
        self._urgent = 0  # urgent items among _waiting (read without the lock between steps)
        self._stopping = False

    def call(self, fn: Callable[[], T], *, urgent: bool = False, background: bool = False) -> T:
        """Run `fn` on the compute thread and return what it returns (or raise what it raises).
        `urgent` goes before every waiting item; `background` as if it came BACKGROUND_LAG items later.

        If `fn` returns a generator, the thread runs it step by step and returns what it returns;
        urgent items waiting between two steps of an ordinary one run there."""
        if threading.current_thread() is self:
            result = fn()  # already on it: queueing behind ourselves would never return
            return complete(result) if isinstance(result, Generator) else result
        ticket = next(self._tickets) + (BACKGROUND_LAG if background else 0)
        work = _Work(0 if urgent else 1, ticket, background, fn)
        with self._ready:
            if self._stopping:
                raise RuntimeError("the compute thread has stopped")
            heapq.heappush(self._waiting, work)
            self._urgent += work.rank == 0
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
                work = self._pop()
            self._run(work)

    def waiting(self) -> int:
        """Items handed to `call` that have not started (what a test waits on to order arrivals)."""
        with self._ready:
            return len(self._waiting)

    @property
    def stopping(self) -> bool:
        """`stop` has been called: nothing more is accepted."""
        return self._stopping

    def _pop(self) -> _Work:
        work = heapq.heappop(self._waiting)
        self._urgent -= work.rank == 0
        return work

    def _run(self, work: _Work) -> None:
        try:
            result = self._measured(work.fn, told=False)
            if isinstance(result, Generator):
                result = self._steps(result, work)
            work.result = result
        except BaseException as exc:  # handed back to the caller, which decides
            work.error = exc
        work.done.set()

    def _steps(self, steps: Generator[Any, Any, Any], work: _Work) -> Any:
        """Run an item's steps; between two steps of an ordinary item, the urgent items waiting."""
        while True:
            try:
                self._measured(lambda: next(steps))
            except StopIteration as done:
                return done.value
            if work.rank != 1:
                continue  # urgent work runs whole
            while self._urgent:
                with self._ready:
                    if not self._waiting or self._waiting[0].rank != 0:
                        break
                    urgent = self._pop()
                self._run(urgent)

    def _measured(self, fn: Callable[[], T], *, told: bool = True) -> T:
        """`fn()` on the thread count `threads` says; `told`: telling it what the call took. Only
        the steps of a generator item are told (an engine's steps, a batch's layers): a plain item
        (an admission, a step's tokens taken in) is host work, whose one thread says nothing of
        how the team runs."""
        if self.threads is None:
            return fn()
        apply(self.threads)
        if not told:
            return fn()
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            return fn()
        finally:
            self.threads.ran(time.perf_counter() - wall, time.process_time() - cpu)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Run what is already queued, then end the thread; later calls raise."""
        with self._ready:
            self._stopping = True
            self._ready.notify()
        if self.is_alive():
            self.join(timeout_s)
