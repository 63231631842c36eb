"""How many torch threads a stage worker's steps run on: its share of the host, and the host's
other CPUs while the other processes leave them mostly idle.

On a host it shares with other processes (`conveyor up`: the api, the batcher, Redis, the other
stages), a stage worker is given a share of the cores (`app.stack.torch_threads`: the cores but
one, split between the stage workers). A thread team that spans a core another process is busy on
waits for its descheduled thread at every kernel: on this project's 2-core machine, with a busy loop
on the other core, a decode step of 16 rows took 195 ms on two threads against 62 ms on one. With
the other core idle the same team is faster: a 150-token prefill 150 against 240 ms, a 64-row
decode step 141 against 220 ms (docs/benchmarks.md, "Threads that follow the host's load").

So a worker whose thread count is not fixed (`CONVEYOR_TORCH_THREADS` unset) runs its steps on its
share, and on every CPU it may use (a cgroup's CPU quota bounds them) while the others are mostly
idle. Two readings decide:

- **On its share**, what the other processes use of this worker's CPUs over a second of wall time:
  the host's busy time on them (`/proc/stat`) less this process's own CPU time. Below `IDLE` of
  the cores it would borrow, the worker widens (quiet: 0.01-0.03 cores; the api and the load's
  client at 64 streams: about 0.3; the other stage of a pipeline at one stream, which works while
  this one waits for it: about 0.5; a busy loop: 1.0).
- **Wide**, how much of its thread team ran over half a second of steps: this process's CPU time
  over the steps' wall time (a team whose threads all run uses a core each, spinning at its
  barriers included: 1.97-1.99 of 2 quiet, 1.25-1.31 beside a busy loop). Below its share plus
  `RAN` of the borrowed cores, a thread waited for a core it shares: the worker goes back.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

from app.core.cpus import allowed

log = logging.getLogger(__name__)

IDLE = 0.6  # widen while the others use less than this of the cores to borrow (their count, in cores)
RAN = 0.4  # go back while the team's use is below its share plus this of the borrowed cores
SHARE_WINDOW_S = 1.0
WIDE_WINDOW_S = 0.5


def busy_s(cpus: Iterable[int], stat: Path = Path("/proc/stat")) -> float:
    """Seconds the host's CPUs `cpus` have spent busy since boot (everything but idle and iowait)."""
    wanted = {f"cpu{c}" for c in cpus}
    ticks = 0
    with stat.open() as lines:
        for line in lines:
            name, _, rest = line.partition(" ")
            if name in wanted:
                fields = [int(v) for v in rest.split()]
                ticks += sum(fields[:8]) - fields[3] - fields[4]  # guest time is inside user already
    return ticks / os.sysconf("SC_CLK_TCK")


def quota_cores(path: Path = Path("/sys/fs/cgroup/cpu.max")) -> int | None:
    """The cores this process's cgroup may use at most (cgroup v2 `cpu.max`), None without a quota."""
    try:
        quota, period = path.read_text().split()
    except (OSError, ValueError):
        return None
    return None if quota == "max" else max(1, math.ceil(int(quota) / int(period)))


class Threads:
    """The thread count of a compute thread's next step, from what its steps and the host did.

    `ran(wall_s, cpu_s)` after each step (its wall time, this process's CPU time meanwhile);
    `count` is what the next step runs on. `fixed` keeps `share` always."""

    def __init__(
        self,
        share: int,
        cpus: Sequence[int],
        *,
        fixed: bool = False,
        clock: Callable[[], float] = time.monotonic,
        cpu_time: Callable[[], float] = time.process_time,
        host_busy: Callable[[], float] | None = None,
    ) -> None:
        self.cpus = list(cpus)
        quota = None if fixed else quota_cores()
        self.most = share if fixed else min(len(self.cpus), quota or len(self.cpus))
        self.share = max(1, min(share, self.most))
        self.fixed = fixed or self.most <= self.share
        self.count = self.share
        self._clock, self._cpu_time = clock, cpu_time
        self._host_busy = host_busy or (lambda: busy_s(self.cpus))
        self.changes = 0  # how many times the count changed (logged, and what a test reads)
        self._open()

    def describe(self) -> str:
        """The count for a log line: "1", or "1-2" where it widens."""
        return str(self.share) if self.fixed else f"{self.share}-{self.most}"

    @property
    def borrowed(self) -> int:
        return self.most - self.share

    def ran(self, wall_s: float, cpu_s: float) -> None:
        """A step ran for `wall_s`, this process using `cpu_s` of CPU meanwhile."""
        if self.fixed:
            return
        self._wall += wall_s
        self._cpu += cpu_s
        if self.count > self.share:
            if self._wall >= WIDE_WINDOW_S:
                used = self._cpu / self._wall
                if used < self.share + RAN * self.borrowed:
                    self._set(self.share, f"its team ran on {used:.2f} of {self.count} cores")
                self._open()
            return
        elapsed = self._clock() - self._started
        if elapsed >= SHARE_WINDOW_S:
            others = (self._host_busy() - self._busy - (self._cpu_time() - self._own)) / elapsed
            if others < IDLE * self.borrowed:
                self._set(self.most, f"the other processes used {max(0.0, others):.2f} cores")
            self._open()

    def _open(self) -> None:
        """Start a window of readings."""
        self._wall = self._cpu = 0.0
        if self.count == self.share and not self.fixed:
            self._started, self._own, self._busy = self._clock(), self._cpu_time(), self._host_busy()

    def _set(self, count: int, why: str) -> None:
        log.debug("torch threads %d -> %d: %s", self.count, count, why)
        self.count = count
        self.changes += 1


def fixed(count: int) -> Threads:
    """A thread count that never moves (`CONVEYOR_TORCH_THREADS`)."""
    return Threads(count, allowed(), fixed=True)


def elastic(share: int | None) -> Threads:
    """A worker's thread count: `share` (default: every CPU it may use but one), widened to all of
    them while the others are idle."""
    cpus = allowed()
    return Threads(share or max(1, len(cpus) - 1), cpus)


def apply(threads: Threads) -> None:
    """Run this thread's next torch kernels on `threads.count` threads (a call only on a change)."""
    if torch.get_num_threads() != threads.count:
        torch.set_num_threads(threads.count)
