"""The direct lane on a real Redis: in order, bytes intact, bad messages dropped, gone when stopped."""

import queue
import uuid

import pytest
import torch

from app.core.protocol import StepMessage
from app.partitions.codecs import decode_tensor, encode_tensor
from app.workers import lane

POLL_S = 0.05  # each test stops its consumer: not a whole second's BRPOP to wait out


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
    consumer = lane.LaneConsumer(redis, key, got.put, poll_s=POLL_S)
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

    consumer = lane.LaneConsumer(redis, key, handle, poll_s=POLL_S)
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
    consumer = lane.LaneConsumer(redis, key, lambda wire: None, poll_s=POLL_S)
    consumer.start()
    consumer.stop()
    assert not consumer.is_alive()
    assert redis.exists(key) == 0
