"""`aio.stop` ends a task that loses a cancel (as one awaiting redis-py can on Python 3.11), keeps
the task's outcome, and lets a cancel of its caller through."""

from __future__ import annotations

import asyncio

import pytest

from app.core import aio


def test_a_task_that_loses_the_first_cancel_is_still_stopped() -> None:
    async def main() -> int:
        cancels = 0

        async def stubborn() -> None:
            nonlocal cancels
            while True:
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    cancels += 1
                    if cancels > 1:
                        raise
                    asyncio.current_task().uncancel()  # type: ignore[union-attr]  # as a lost cancel leaves it

        task = asyncio.ensure_future(stubborn())
        await asyncio.sleep(0)
        await aio.stop(task)
        assert task.cancelled()
        return cancels

    assert asyncio.run(main()) == 2


def test_an_ended_task_keeps_its_outcome() -> None:
    async def main() -> None:
        async def fails() -> None:
            raise ValueError("boom")

        task = asyncio.ensure_future(fails())
        await asyncio.sleep(0)
        await aio.stop(task)  # done already: nothing to cancel, its error neither raised nor lost
        with pytest.raises(ValueError, match="boom"):
            task.result()

    asyncio.run(main())


def test_a_cancelled_caller_is_cancelled_and_does_not_wait_on() -> None:
    async def main() -> None:
        started = asyncio.Event()
        stubborn = True

        async def holds() -> None:
            started.set()
            while True:
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    if not stubborn:
                        raise
                    asyncio.current_task().uncancel()  # type: ignore[union-attr]

        task = asyncio.ensure_future(holds())
        await started.wait()
        caller = asyncio.ensure_future(aio.stop(task))
        await asyncio.sleep(0)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        assert not task.done()  # it swallowed every cancel so far; its stopper did not wait on
        stubborn = False
        await aio.stop(task)
        assert task.cancelled()

    asyncio.run(main())
