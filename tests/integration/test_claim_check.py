"""Claim check on a real Redis: large payloads go through Redis by reference, small ones stay inline."""

import time
import uuid

import msgpack
import pytest
import torch

from app.core.protocol import StepMessage
from app.partitions.claimcheck import ClaimCheck, ClaimMissing
from app.partitions.codecs import decode_tensor, encode_tensor
from tests.tinyapi import forget_keys, namespace_keys

THRESHOLD = 64 * 1024


@pytest.fixture()
def claims(redis):
    namespace = f"test-claim-{uuid.uuid4().hex[:8]}"
    yield ClaimCheck(redis, namespace=namespace, threshold_bytes=THRESHOLD, ttl_s=30)
    forget_keys(redis, namespace)


def over_msgpack(wire: dict) -> dict:
    return msgpack.unpackb(msgpack.packb(wire))


def test_large_payload_goes_through_redis_and_comes_back_identical(claims, redis):
    x = torch.randn(8, 16, 576)  # 295 KB of float32
    wire = encode_tensor(x)
    sent = over_msgpack(claims.put(wire))
    assert "data" not in sent and sent["nbytes"] == len(wire["data"])
    assert sent["claim"].startswith(f"{claims.namespace}:claim:")
    assert redis.get(sent["claim"]) == wire["data"]
    back = claims.get(sent)
    assert back == wire
    assert torch.equal(decode_tensor(back), x)


def test_the_key_is_gone_after_resolve(claims, redis):
    sent = claims.put(encode_tensor(torch.randn(THRESHOLD)))
    claims.get(sent)
    assert redis.exists(sent["claim"]) == 0
    with pytest.raises(ClaimMissing, match="already consumed"):
        claims.get(sent)


def test_the_claim_expires(claims, redis):
    sent = claims.put(encode_tensor(torch.randn(THRESHOLD)))
    ttl_ms = redis.pttl(sent["claim"])
    assert 25_000 < ttl_ms <= 30_000


def test_below_the_threshold_stays_inline(claims, redis):
    wire = encode_tensor(torch.randn(8, 1, 576))  # 18 KB: a decode step's hidden states
    assert len(wire["data"]) < THRESHOLD
    assert claims.put(wire) is wire
    assert claims.get(wire) is wire
    assert namespace_keys(redis, claims.namespace) == []


def test_the_threshold_counts_encoded_bytes(claims):
    x = torch.randn(THRESHOLD // 4 + 1024)  # just over the threshold as float32, under it as float16
    assert "claim" in claims.put(encode_tensor(x))
    assert "data" in claims.put(encode_tensor(x, transport_dtype="float16"))


def test_an_expired_claim_raises(redis):
    namespace = f"test-claim-{uuid.uuid4().hex[:8]}"
    short = ClaimCheck(redis, namespace=namespace, threshold_bytes=0, ttl_s=0.05)
    sent = short.put(encode_tensor(torch.randn(16)))
    deadline = time.monotonic() + 60
    while redis.exists(sent["claim"]):  # Redis expires it after the 50 ms TTL
        assert time.monotonic() < deadline, "the claim did not expire"
        time.sleep(0.01)
    with pytest.raises(ClaimMissing, match=r"expired \(TTL 0.05 s\)"):
        short.get(sent)


def test_a_claim_read_without_consuming_survives_a_redelivery(claims, redis):
    x = torch.randn(THRESHOLD)
    sent = claims.put(encode_tensor(x))
    first = claims.get(sent, consume=False)
    again = claims.get(sent, consume=False)  # the same message delivered a second time
    assert torch.equal(decode_tensor(first), x) and first == again
    claims.discard(sent)
    assert redis.exists(sent["claim"]) == 0


def test_a_stage_message_carries_claims_through_msgpack(claims, redis):
    hidden, mask = torch.randn(8, 128, 576), torch.ones(8, 128, dtype=torch.int8)
    tensors = {"hidden": encode_tensor(hidden), "attention_mask": encode_tensor(mask)}
    msg = StepMessage("b", "m", 1, 2, "prefill", 0, ["a"], tensors=claims.put_all(tensors))
    wire = msg.to_wire()
    assert len(msgpack.packb(wire)) < 4096  # the 2.4 MB payload stays out of the broker
    back = StepMessage.from_wire(over_msgpack(wire))
    assert "claim" in back.tensors["hidden"] and "data" in back.tensors["attention_mask"]
    resolved = claims.get_all(back.tensors)
    assert torch.equal(decode_tensor(resolved["hidden"]), hidden)
    assert torch.equal(decode_tensor(resolved["attention_mask"]), mask)
    assert namespace_keys(redis, claims.namespace) == []


def test_bad_settings_and_clients_are_refused(redis_url):
    import redis as redis_lib

    with pytest.raises(ValueError):
        ClaimCheck(None, namespace="x", threshold_bytes=-1, ttl_s=10)
    with pytest.raises(ValueError):
        ClaimCheck(None, namespace="x", threshold_bytes=0, ttl_s=0)
    text = redis_lib.Redis.from_url(redis_url, decode_responses=True)
    namespace = f"test-claim-{uuid.uuid4().hex[:8]}"
    claims = ClaimCheck(text, namespace=namespace, threshold_bytes=0, ttl_s=10)
    sent = claims.put({"codec": "raw", "dtype": "int8", "shape": [2], "data": b"ab"})
    with pytest.raises(TypeError, match="decode_responses=False"):
        claims.get(sent)
    assert text.exists(sent["claim"]) == 0  # consumed, and gone anyway
