"""Which CPUs a process runs on: CPU lists as Linux writes them ("0-3,6"), and binding to one.

A stage or embeddings worker binds where `CONVEYOR_CPUS` says, before its model's threads start.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


def parse_cpus(text: str) -> frozenset[int]:
    """The CPUs of a list like "0-3,6" (`taskset -c`, cgroup cpusets); ValueError if malformed."""
    cpus: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        first, dash, last = part.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"{text!r} is not a CPU list (like 0-3,6)")
        low, high = int(first), int(last) if dash else int(first)
        if high < low:
            raise ValueError(f"{text!r} is not a CPU list: the range {part} runs backwards")
        cpus.update(range(low, high + 1))
    return frozenset(cpus)


def format_cpus(cpus: Iterable[int]) -> str:
    """A CPU list in its shortest form: [0, 1, 2, 5] -> "0-2,5"."""
    ranges: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


def allowed() -> list[int]:
    """The CPUs this process may run on, in order."""
    return sorted(os.sched_getaffinity(0))


def bind(cpus: Iterable[int]) -> None:
    """Run this process, every thread it has and every one it starts later, on `cpus` only (which
    may lie outside the CPUs it runs on now: a worker started by a bound `conveyor up` moves off
    its parent's). A CPU it may not use (offline, outside its container's cpuset) is refused: a
    wrong list must not pass as a narrower one."""
    wanted = set(cpus)
    tasks = Path("/proc/self/task")
    threads = [int(t) for t in os.listdir(tasks)] if tasks.is_dir() else [0]
    try:
        for thread in threads:
            try:
                os.sched_setaffinity(thread, wanted)
            except ProcessLookupError:  # the thread ended meanwhile
                continue
    except OSError as exc:  # none of them usable
        raise ValueError(f"cannot run on CPUs {format_cpus(wanted) or '(none)'}: {exc.strerror}") from exc
    got = os.sched_getaffinity(0)
    if got != wanted:
        missing = format_cpus(wanted - got)
        raise ValueError(f"cannot run on CPUs {format_cpus(wanted)}: {missing} not available to this process")
