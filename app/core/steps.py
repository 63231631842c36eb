"""Work suspended in steps: a generator that yields where it may be interrupted and returns its result.

A stage's step over its layers (`StagePartition.steps`) and a stage message's handling
(`StageRuntime.run`) are written this way, so the one loop that runs them (the worker's compute
thread) decides what runs between two layers, and nothing runs inside anything else.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any, TypeVar

T = TypeVar("T")

Steps = Generator[None, None, T]


def complete(steps: Generator[Any, Any, T]) -> T:
    """Run suspended work to its end, uninterrupted; what it returns."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
