"""The far end of `bench.hop`: a real Celery stage worker with a relay task, or a plain BRPOP loop.

    python -m bench.hop_worker celery --url URL --namespace NS [--events]
    python -m bench.hop_worker redis --url URL --namespace NS

`celery` is a stage worker: its Celery queue (prefill) and its lane (decode hand-offs), consumed
by the same `serve()` as `app.workers.main` uses. Both modes note two CLOCK_MONOTONIC instants per
message (the clock is system-wide on Linux, so the bench process can subtract its own send
instant): `started`, when the handler runs (Celery task or lane message) or the popped bytes are
unpacked (floor), and `ready`, when the hidden states are decoded (claim resolved first, if any).
They push `[started, ready]` onto a results list the bench pops, so one message is in flight at a
time.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import msgpack

from app.core.broker import create_celery_app
from app.core.config import Settings
from app.core.protocol import StepMessage
from app.core.redis import sync_client
from app.partitions.claimcheck import ClaimCheck
from app.partitions.codecs import decode_tensor
from app.workers.celery_app import register_step_task

RESULTS_TTL_S = 600


def now_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def celery_queue(namespace: str) -> str:
    return f"{namespace}.hop"


def floor_queue(namespace: str) -> str:
    return f"{namespace}:hop:floor"


def lane_key(namespace: str) -> str:
    return f"{namespace}:hop:lane"


def results_key(namespace: str) -> str:
    return f"{namespace}:hop:results"


class Relay:
    """Decode what arrived, then report when it started and when its tensor was ready."""

    def __init__(self, url: str, namespace: str) -> None:
        self.redis = sync_client(url)
        self.claims = ClaimCheck(self.redis, namespace=namespace, threshold_bytes=0, ttl_s=60)
        self.results = results_key(namespace)

    def __call__(self, wire: dict[str, Any], started: int) -> None:
        msg = StepMessage.from_wire(wire)
        decode_tensor(self.claims.get(msg.tensors["hidden"]))  # hidden: [B, S, D]
        ready = now_ns()
        pipe = self.redis.pipeline(transaction=False)
        pipe.rpush(self.results, msgpack.packb([started, ready]))
        pipe.expire(self.results, RESULTS_TTL_S)
        pipe.execute()


def run_celery(url: str, namespace: str, events: bool) -> None:
    """A stage worker as `app.workers.main` starts one: `serve()` with the project's app factory,
    step task and lane consumer, sharing one lock as the stage runtime does."""
    import threading

    from app.workers.celery_app import serve
    from app.workers.lane import LaneConsumer

    relay = Relay(url, namespace)
    settings = Settings(namespace=namespace, celery_events=events)
    app = create_celery_app(settings, url)
    one_at_a_time = threading.Lock()

    def handle(wire: dict[str, Any]) -> None:
        started = now_ns()
        with one_at_a_time:
            relay(wire, started)

    register_step_task(app, handle)
    serve(
        app,
        settings,
        redis=relay.redis,
        heartbeat_key=f"{namespace}:hop:workers",
        worker="hop",
        hostname=f"hop-{namespace}",
        queues=[celery_queue(namespace)],
        lane=LaneConsumer(relay.redis, lane_key(namespace), handle),
        loglevel="WARNING",
    )


def run_floor(url: str, namespace: str) -> None:
    """The least a hop through Redis can cost: BRPOP the packed message and unpack it."""
    relay = Relay(url, namespace)
    queue = floor_queue(namespace)
    while True:
        popped = relay.redis.brpop([queue], timeout=1)
        if popped is not None:
            wire = msgpack.unpackb(popped[1])
            relay(wire, now_ns())


def main() -> None:
    parser = argparse.ArgumentParser(description="the far end of bench.hop")
    parser.add_argument("mode", choices=["celery", "redis"])
    parser.add_argument("--url", required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--events", action="store_true", help="Celery task events on (Flower)")
    args = parser.parse_args()
    if args.mode == "celery":
        run_celery(args.url, args.namespace, args.events)
    else:
        run_floor(args.url, args.namespace)


if __name__ == "__main__":
    main()
