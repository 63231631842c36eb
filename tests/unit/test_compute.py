"""The stage worker's compute thread: one thread runs all model work, in turn, urgent work first."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection

import pytest

from app.workers.compute import BACKGROUND_LAG, ComputeThread


@pytest.fixture
def compute():  # type: ignore[no-untyped-def]
    thread = ComputeThread()
    thread.start()
    yield thread
    thread.stop()


def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Wait for `condition` to hold (checked every millisecond); fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def occupy(compute: ComputeThread) -> tuple[threading.Event, threading.Thread]:
    """Start a long item (a step in progress); set the event to let it finish."""
    release, started = threading.Event(), threading.Event()

    def step() -> None:
        started.set()
        release.wait(5)

    caller = threading.Thread(target=compute.call, args=(step,))
    caller.start()
    assert started.wait(5)
    return release, caller


def queue_in_order(
    compute: ComputeThread, items: list[tuple[str, bool]], order: list[str], background: Collection[str] = ()
) -> list[threading.Thread]:
    """Hand `items` (name, urgent) to the compute thread from threads of their own, one after the other:
    each is waiting in its queue before the next arrives (the thread is busy with other work). Those
    named in `background` are handed over as background items."""
    callers = []
    for name, urgent in items:
        waiting = compute.waiting()
        kwargs = {"urgent": urgent, "background": name in background}
        caller = threading.Thread(
            target=compute.call, args=(lambda name=name: order.append(name),), kwargs=kwargs
        )
        caller.start()
        callers.append(caller)
        until(lambda waiting=waiting: compute.waiting() == waiting + 1)
    return callers


def test_all_work_runs_on_the_one_compute_thread(compute):  # type: ignore[no-untyped-def]
    seen: set[int] = set()
    callers = [
        threading.Thread(target=compute.call, args=(lambda: seen.add(threading.get_ident()),))
        for _ in range(4)
    ]
    for caller in callers:
        caller.start()
    seen.add(compute.call(threading.get_ident))
    for caller in callers:
        caller.join(5)
    assert seen == {compute.ident}
    assert compute.ident != threading.get_ident()


def test_it_returns_what_the_work_returns_and_raises_what_it_raises(compute):  # type: ignore[no-untyped-def]
    assert compute.call(lambda: 6 * 7) == 42

    def broken() -> None:
        raise ValueError("bad batch")

    with pytest.raises(ValueError, match="bad batch"):
        compute.call(broken)
    assert compute.call(lambda: "still serving") == "still serving"


def test_waiting_work_runs_in_arrival_order_so_a_waiting_prefill_is_not_starved(compute):  # type: ignore[no-untyped-def]
    order: list[str] = []
    release, step = occupy(compute)  # the lane thread's decode step is running
    callers = queue_in_order(compute, [("prefill", False), ("next decode step", False)], order)
    release.set()
    for caller in (step, *callers):
        caller.join(5)
    assert order == ["prefill", "next decode step"]


def test_an_urgent_prefill_goes_before_waiting_work_but_not_the_step_in_progress(compute):  # type: ignore[no-untyped-def]
    order: list[str] = []
    release, step = occupy(compute)
    items = [
        ("normal prefill", False),
        ("decode step", False),
        ("high prefill", True),
        ("realtime prefill", True),
    ]
    callers = queue_in_order(compute, items, order)
    assert order == []  # nothing overtakes the step in progress
    release.set()
    for caller in (step, *callers):
        caller.join(5)
    assert order == ["high prefill", "realtime prefill", "normal prefill", "decode step"]


def test_batch_class_prefills_wait_for_interactive_work_but_not_forever(compute):  # type: ignore[no-untyped-def]
    order: list[str] = []
    release, step = occupy(compute)
    later = [f"decode step {i}" for i in range(BACKGROUND_LAG + 1)]
    items = [(name, False) for name in ["batch prefill", "normal prefill", *later]]
    callers = queue_in_order(compute, items, order, background={"batch prefill"})
    release.set()
    for caller in (step, *callers):
        caller.join(5)
    # the interactive prefill goes first; the batch prefill runs once BACKGROUND_LAG later items ran
    assert order == [
        "normal prefill",
        *later[: BACKGROUND_LAG - 1],
        "batch prefill",
        *later[BACKGROUND_LAG - 1 :],
    ]


def test_a_stopped_compute_thread_finishes_what_was_queued_and_refuses_more():
    compute = ComputeThread()
    compute.start()
    order: list[str] = []
    release, step = occupy(compute)
    callers = queue_in_order(compute, [("queued", False)], order)
    stopper = threading.Thread(target=compute.stop)
    stopper.start()
    until(lambda: compute.stopping)  # stopped while "queued" still waits
    release.set()
    for caller in (step, *callers, stopper):
        caller.join(5)
    assert order == ["queued"]
    assert not compute.is_alive()
    with pytest.raises(RuntimeError, match="stopped"):
        compute.call(lambda: None)


def test_work_that_calls_back_into_the_compute_thread_runs_at_once(compute):  # type: ignore[no-untyped-def]
    assert compute.call(lambda: compute.call(lambda: "nested")) == "nested"


def test_urgent_work_runs_between_the_steps_of_ordinary_work_in_progress(compute):  # type: ignore[no-untyped-def]
    """An ordinary item suspended between two layers (a generator's yield): the urgent item waiting
    runs there, from the thread's loop, and the suspended one resumes; the ordinary decode step that
    arrived before the urgent one waits for both. What the generator returns is what `call` returns."""
    order: list[str] = []
    started, proceed = threading.Event(), threading.Event()
    results: list[str] = []

    def ordinary_step():  # type: ignore[no-untyped-def]
        order.append("layer 1")
        started.set()
        proceed.wait(5)  # meanwhile another decode step and an urgent prefill arrive
        yield  # between two layers
        order.append("layer 2")
        return "logits"

    def high_prefill():  # type: ignore[no-untyped-def]
        order.append("high prefill, layer 1")
        yield  # urgent work is not suspended for anything
        order.append("high prefill, layer 2")

    step = threading.Thread(target=lambda: results.append(compute.call(ordinary_step)))
    step.start()
    assert started.wait(5)
    callers = queue_in_order(compute, [("decode step", False)], order)
    urgent = threading.Thread(target=compute.call, args=(high_prefill,), kwargs={"urgent": True})
    urgent.start()
    until(lambda: compute.waiting() == 2)  # the decode step and the urgent prefill both wait
    proceed.set()
    for caller in (step, urgent, *callers):
        caller.join(5)
    assert order == ["layer 1", "high prefill, layer 1", "high prefill, layer 2", "layer 2", "decode step"]
    assert results == ["logits"]


def test_urgent_work_is_not_suspended_for_urgent_work(compute):  # type: ignore[no-untyped-def]
    order: list[str] = []
    started, proceed = threading.Event(), threading.Event()

    def first_urgent():  # type: ignore[no-untyped-def]
        started.set()
        proceed.wait(5)  # meanwhile a second urgent prefill arrives
        yield
        order.append("first urgent")

    first = threading.Thread(target=compute.call, args=(first_urgent,), kwargs={"urgent": True})
    first.start()
    assert started.wait(5)
    callers = queue_in_order(compute, [("second urgent", True)], order)
    proceed.set()
    for caller in (first, *callers):
        caller.join(5)
    assert order == ["first urgent", "second urgent"]


def test_a_generator_handed_over_from_the_compute_thread_itself_runs_whole(compute):  # type: ignore[no-untyped-def]
    def steps():  # type: ignore[no-untyped-def]
        yield
        yield
        return "done"

    assert compute.call(lambda: compute.call(steps)) == "done"


def test_an_ordinary_item_runs_whole_and_the_items_waiting_follow_in_arrival_order(compute):  # type: ignore[no-untyped-def]
    """A prefill runs whole, its steps included: the decode steps and the prefill that arrived
    meanwhile run after it, in the order they arrived."""
    order: list[str] = []
    started, proceed = threading.Event(), threading.Event()

    def prefill(name: str):  # type: ignore[no-untyped-def]
        def steps():  # type: ignore[no-untyped-def]
            order.append(f"{name} layer 1")
            started.set()
            proceed.wait(5)  # meanwhile a decode step, another prefill and a second decode step arrive
            yield
            order.append(f"{name} layer 2")

        return steps

    first = threading.Thread(target=compute.call, args=(prefill("p"),))
    first.start()
    assert started.wait(5)
    callers = queue_in_order(compute, [("decode a", False)], order)
    second = threading.Thread(target=compute.call, args=(prefill("q"),))
    second.start()
    until(lambda: compute.waiting() == 2)
    callers += queue_in_order(compute, [("decode b", False)], order)
    proceed.set()
    for caller in (first, second, *callers):
        caller.join(5)
    assert order == ["p layer 1", "p layer 2", "decode a", "q layer 1", "q layer 2", "decode b"]
