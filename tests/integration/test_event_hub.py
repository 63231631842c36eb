"""The API's event hub against a real Redis: it stops when told, whenever it is told.

Its listener subscribes and reads through redis-py, which awaits connects and writes through
`asyncio.wait_for`; on Python 3.11 a cancel that lands as such a wait finishes is lost. An API whose
start fails just after the hub started (fsync refused, say) stops the hub at once, so a stop must end
the listener wherever the cancel lands, or the API never finishes stopping."""

from __future__ import annotations

import asyncio
import uuid

import redis.asyncio

from app.api.app import api_redis
from app.api.events import EventHub
from app.core.keys import Keys

STOP_BOUND_S = 10.0  # far above a stop's time (one re-cancel interval at worst); a bound, not a timing


def test_the_hub_stops_whenever_it_is_stopped(redis_url: str) -> None:
    async def main() -> None:
        client = api_redis(redis_url)
        keys = Keys(f"test-{uuid.uuid4().hex[:8]}")
        try:
            for round_ in range(24):  # the cancel lands at a different point of the subscribe each time
                hub = EventHub(client, keys)
                await hub.start()
                for _ in range(round_):
                    await asyncio.sleep(0)
                stopping = asyncio.ensure_future(hub.stop())
                await asyncio.wait({stopping}, timeout=STOP_BOUND_S)
                assert stopping.done(), f"round {round_}: the hub's listener ran on after its stop"
                assert hub._task is not None and hub._task.done() and not hub.subscribed
        finally:
            await client.aclose()

    asyncio.run(main())


def test_a_subscribed_hub_relays_and_then_stops(redis_url: str) -> None:
    async def main() -> None:
        client: redis.asyncio.Redis = api_redis(redis_url)
        keys = Keys(f"test-{uuid.uuid4().hex[:8]}")
        hub = EventHub(client, keys)
        await hub.start()
        try:
            async with hub.watch("j1") as woke:
                async with asyncio.timeout(STOP_BOUND_S):
                    while not hub.subscribed:
                        await asyncio.sleep(0.01)
                await client.publish(keys.announce("j1"), "1")
                await asyncio.wait_for(woke.wait(), STOP_BOUND_S)
        finally:
            await asyncio.wait_for(hub.stop(), STOP_BOUND_S)
        await client.aclose()

    asyncio.run(main())
