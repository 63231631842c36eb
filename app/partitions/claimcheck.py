"""Claim check (docs/architecture.md): a tensor too large for the broker travels through Redis by reference.

Celery's Redis transport base64-encodes the message body inside a JSON envelope, pushes it onto a
list, and with `acks_late` keeps a second copy in the `unacked` hash until the step is acknowledged:
every inline byte is copied several times in Python and twice in Redis, and one big message blocks
Redis's single thread for everyone while it moves. Above `threshold_bytes` the encoded `data` goes
to Redis once, as raw bytes, under an expiring key, and the wire dict carries the key instead:

    {"codec", "dtype", "shape", "data"}  ->  {"codec", "dtype", "shape", "claim", "nbytes"}

Who calls: the sending stage `put`s each encoded tensor before `send_task`; the receiving stage
`get`s it before `decode_tensor`. `get` consumes the claim (GETDEL) by default; a caller that wants
a redelivered message to find its payload again reads with `consume=False` and `discard`s the
claim once the step's output is sent. Every claim expires after `ttl_s` whatever happens.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from app.partitions.codecs import Wire

CLAIM_FIELD = "claim"


class ClaimMissing(LookupError):
    """The claimed payload is not in Redis: it expired, or another delivery already consumed it."""

    def __init__(self, key: str, ttl_s: float) -> None:
        super().__init__(
            f"claim-checked tensor {key!r} is gone: it expired (TTL {ttl_s:g} s) "
            "or was already consumed by an earlier delivery of this message"
        )
        self.key = key


def claim_key(namespace: str, claim_id: str) -> str:
    """String: one claim-checked tensor payload (raw encoded bytes), expiring."""
    return f"{namespace}:claim:{claim_id}"


@dataclass(frozen=True)
class ClaimCheck:
    redis: Any  # a sync redis.Redis that returns bytes (decode_responses=False)
    namespace: str
    threshold_bytes: int  # payloads of at least this many bytes go by claim check
    ttl_s: float  # how long an unclaimed payload waits before Redis drops it

    def __post_init__(self) -> None:
        if self.threshold_bytes < 0 or self.ttl_s <= 0:
            raise ValueError(f"claim check needs threshold_bytes >= 0 and ttl_s > 0, got {self}")

    def put(self, wire: Wire) -> Wire:
        """The wire dict to send: `data` moved to Redis when it is at least the threshold."""
        data = wire.get("data")
        if CLAIM_FIELD in wire or data is None or len(data) < self.threshold_bytes:
            return wire
        key = claim_key(self.namespace, uuid.uuid4().hex)
        self.redis.set(key, data, px=max(1, round(self.ttl_s * 1000)))
        claimed = {k: v for k, v in wire.items() if k != "data"}
        return {**claimed, CLAIM_FIELD: key, "nbytes": len(data)}

    def get(self, wire: Wire, *, consume: bool = True) -> Wire:
        """The wire dict with its `data` back; ClaimMissing when the payload expired or was taken."""
        if CLAIM_FIELD not in wire:
            return wire
        key = wire[CLAIM_FIELD]
        data = self.redis.getdel(key) if consume else self.redis.get(key)
        if data is None:
            raise ClaimMissing(key, self.ttl_s)
        if not isinstance(data, bytes):
            raise TypeError("the claim check needs a Redis client with decode_responses=False")
        if len(data) != wire.get("nbytes", len(data)):
            raise ValueError(f"claim {key!r} holds {len(data)} bytes, the message says {wire['nbytes']}")
        resolved = {k: v for k, v in wire.items() if k not in (CLAIM_FIELD, "nbytes")}
        return {**resolved, "data": data}

    def discard(self, wire: Wire) -> None:
        """Drop a claim read with `consume=False` (no-op for an inline tensor)."""
        if CLAIM_FIELD in wire:
            self.redis.delete(wire[CLAIM_FIELD])

    def put_all(self, tensors: Mapping[str, Wire]) -> dict[str, Wire]:
        """`put` over a stage message's tensors."""
        return {name: self.put(wire) for name, wire in tensors.items()}

    def get_all(self, tensors: Mapping[str, Wire], *, consume: bool = True) -> dict[str, Wire]:
        """`get` over a stage message's tensors."""
        return {name: self.get(wire, consume=consume) for name, wire in tensors.items()}
