"""How the project's Lua scripts are called: their keys by name, their arguments as one object.

`Script(redis, body)` registers a script with a client (sync, asyncio, or a pipeline), and a call
names what it passes: `script(keys={"job": ..., "streams": [...]}, args={"ttl": 60, ...})`. Its Lua
reads `K.job`, `K.streams[i]`, `A.ttl` (`ARGUMENTS`, which starts every script), never a position
computed from counts. The keys stay KEYS, so Redis knows which keys a script touches.

Also here: the lease scripts more than one module holds a lease with.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

# A: the arguments; K: the keys by name (a list of keys for a name given a list), as `script_call`
# sent them.
ARGUMENTS = """
local A = cjson.decode(ARGV[1])
local K = {}
for _, place in ipairs(A.keys) do
  local name, first, count = place[1], place[2], place[3]
  if count < 0 then
    K[name] = KEYS[first]
  else
    local list = {}
    for i = first, first + count - 1 do list[#list + 1] = KEYS[i] end
    K[name] = list
  end
end
"""


def script_call(
    keys: Mapping[str, str | Sequence[str] | None], args: Mapping[str, Any]
) -> tuple[list[str], list[str]]:
    """A script's KEYS and ARGV from its keys by name (one key, a list of keys, or None for one it is
    not given) and its arguments by name: ARGV is one JSON object, the arguments and the keys'
    places, which `ARGUMENTS` turns back into `A` and `K`. An argument a call has no value for is
    left out: None (JSON's null, which is not Lua's nil but a value that is true) and NaN are refused."""
    if missing := [name for name, value in args.items() if value is None]:
        raise ValueError(f"script arguments without a value: {missing} (leave them out)")
    flat: list[str] = []
    places: list[tuple[str, int, int]] = []  # name, first index, count (-1: one key, not a list)
    for name, value in keys.items():
        if value is None:
            continue
        if isinstance(value, str):
            places.append((name, len(flat) + 1, -1))
            flat.append(value)
        else:
            places.append((name, len(flat) + 1, len(value)))
            flat.extend(value)
    encoded = json.dumps({**args, "keys": places}, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return flat, [encoded]


class Script:
    """A script registered with `redis` (a client or a pipeline, sync or asyncio), `ARGUMENTS` first.
    A call returns what redis-py's returns: the reply, or a coroutine of it on an asyncio client."""

    def __init__(self, redis: Any, body: str) -> None:
        self.body = ARGUMENTS + body
        self._registered = redis.register_script(self.body)

    def __call__(
        self,
        *,
        keys: Mapping[str, str | Sequence[str] | None],
        args: Mapping[str, Any] | None = None,
        client: Any = None,
    ) -> Any:
        flat, argv = script_call(keys, args or {})
        return self._registered(keys=flat, args=argv, client=client)


# A lease (K.lease, a string key naming its holder): held by A.holder for A.ms more milliseconds if
# it holds it or nobody does; 1 when it holds it now, 0 when another does.
HOLD_LEASE = """
if redis.call('GET', K.lease) == A.holder then return redis.call('PEXPIRE', K.lease, A.ms) end
return redis.call('SET', K.lease, A.holder, 'NX', 'PX', A.ms) and 1 or 0
"""

# K.lease deleted if it still holds A.holder (compare and delete); 1 when deleted.
RELEASE_IF_HELD = """
if redis.call('GET', K.lease) == A.holder then return redis.call('DEL', K.lease) end
return 0
"""
