"""The direct lane on a real Redis: in order, bytes intact, bad messages dropped, gone when stopped."""

import queue
import uuid

import pytest
import torch

from app.core.protocol import StepMessage
from app.partitions.codecs import decode_tensor, encode_tensor
from app.workers import lane


@pytest.fixture()
def key(redis):
    name = f"test-lane-{uuid.uuid4().hex[:8]}:lane:m:0:w"
    yield name
    redis.delete(name)


def step(i: int, hidden: torch.Tensor) -> StepMessage:
    return StepMessage(
        batch_id="b", model="m", stage=1, num_stages=2, kind="decode", step=i, seq_ids=["j"],
        tensors={"hidden": encode_tensor(hidden)},
    )  # fmt: skip


def test_messages_arrive_in_order_with_their_tensors(redis, key):
    got: queue.Queue[dict] = queue.Queue()
    consumer = lane.LaneConsumer(redis, key, got.put)
    consumer.start()
    try:
        hidden = [torch.randn(8, 1, 576) for _ in range(5)]
        for i, h in enumerate(hidden):
            lane.send(redis, key, step(i, h).to_wire())
        for i, h in enumerate(hidden):
            msg = StepMessage.from_wire(got.get(timeout=5))
            assert msg.step == i
            assert torch.equal(decode_tensor(msg.tensors["hidden"]), h)
    finally:
        consumer.stop()


def test_a_bad_message_or_a_failing_handler_does_not_stop_the_lane(redis, key):
    got: queue.Queue[dict] = queue.Queue()

    def handle(wire: dict) -> None:
        if wire.get("boom"):
            raise RuntimeError("handler failed")
        got.put(wire)

    consumer = lane.LaneConsumer(redis, key, handle)
    consumer.start()
    try:
        redis.lpush(key, b"\xc1 not msgpack")
        lane.send(redis, key, {"boom": True})
        lane.send(redis, key, {"ok": 1})
        assert got.get(timeout=5) == {"ok": 1}
        assert consumer.is_alive()
    finally:
        consumer.stop()


def test_the_lane_expires_and_is_deleted_when_its_consumer_stops(redis, key):
    lane.send(redis, key, {"x": 1}, ttl_s=60)
    assert 0 < redis.ttl(key) <= 60
    consumer = lane.LaneConsumer(redis, key, lambda wire: None)
    consumer.start()
    consumer.stop()
    assert not consumer.is_alive()
    assert redis.exists(key) == 0


def test_turns_are_taken_in_arrival_order_so_a_waiting_prefill_is_not_starved():
    import threading
    import time

    turns = lane.TurnLock()
    order: list[str] = []

    def take(name: str) -> None:
        with turns:
            order.append(name)

    turns.__enter__()  # the lane thread is running a step
    prefill = threading.Thread(target=take, args=("prefill",))
    prefill.start()
    time.sleep(0.05)  # the prefill is waiting now
    turns.__exit__()
    take("next decode step")  # the lane thread comes straight back for its next step
    prefill.join(5)
    assert order == ["prefill", "next decode step"]


def test_an_urgent_prefill_goes_before_waiting_decode_steps_but_not_the_step_in_progress():
    import threading
    import time

    turns = lane.TurnLock()
    order: list[str] = []

    def take(name: str, urgent: bool) -> None:
        with turns.turn(urgent=urgent):
            order.append(name)

    turns.acquire()  # a decode step is running
    waiters = [
        threading.Thread(target=take, args=("normal prefill", False)),
        threading.Thread(target=take, args=("decode step", False)),
        threading.Thread(target=take, args=("high prefill", True)),
        threading.Thread(target=take, args=("realtime prefill", True)),
    ]
    for waiter in waiters:
        waiter.start()
        time.sleep(0.05)  # each is waiting before the next arrives
    assert order == []  # nobody takes the step in progress's turn
    turns.release()
    for waiter in waiters:
        waiter.join(5)
    assert order == ["high prefill", "realtime prefill", "normal prefill", "decode step"]
