"""The scripts' calling convention (app/core/scripts.py): keys by name, arguments as one object, on a
real Redis."""

from __future__ import annotations

import json
import uuid

import pytest

from app.core.scripts import HOLD_LEASE, RELEASE_IF_HELD, Script, script_call

# What a script saw: its keys by name (a list where it was given one) and its arguments.
ECHO = """
local seen = {}
for name, key in pairs(K) do seen[#seen + 1] = name end
table.sort(seen)
local out = {}
for _, name in ipairs(seen) do
  local key = K[name]
  out[#out + 1] = name .. '=' .. (type(key) == 'table' and ('[' .. table.concat(key, ',') .. ']') or key)
end
return {table.concat(out, ' '), A.n, A.text, tostring(A.absent), #A.list, A.nested.flag and 'yes' or 'no'}
"""


def test_keys_are_flat_in_order_and_their_places_travel_with_the_arguments() -> None:
    keys, argv = script_call({"one": "a", "many": ["b", "c"], "none": None, "last": "d"}, {"n": 1})
    assert keys == ["a", "b", "c", "d"]
    assert json.loads(argv[0]) == {"n": 1, "keys": [["one", 1, -1], ["many", 2, 2], ["last", 4, -1]]}


def test_a_script_reads_its_keys_and_arguments_by_name(redis) -> None:  # type: ignore[no-untyped-def]
    echo = Script(redis, ECHO)
    reply = echo(
        keys={"job": "j", "streams": ["s1", "s2", "s3"], "empty": [], "missing": None},
        args={"n": 7, "text": 'é, "quoted"\n', "list": [1, 2, 3], "nested": {"flag": True}},
    )
    seen, n, text, absent, count, flag = [x.decode() if isinstance(x, bytes) else x for x in reply]
    assert seen == "empty=[] job=j streams=[s1,s2,s3]"  # a key given None is not there at all
    assert (n, text, absent, count, flag) == (7, 'é, "quoted"\n', "nil", 3, "yes")


def test_a_lease_is_held_renewed_and_released_only_by_its_holder(redis) -> None:  # type: ignore[no-untyped-def]
    lease = f"test-lease-{uuid.uuid4().hex}"
    hold, release = Script(redis, HOLD_LEASE), Script(redis, RELEASE_IF_HELD)
    try:
        assert hold(keys={"lease": lease}, args={"holder": "a", "ms": 60_000}) == 1
        assert hold(keys={"lease": lease}, args={"holder": "b", "ms": 60_000}) == 0
        assert hold(keys={"lease": lease}, args={"holder": "a", "ms": 60_000}) == 1  # renewed
        assert release(keys={"lease": lease}, args={"holder": "b"}) == 0
        assert redis.get(lease) == b"a"
        assert release(keys={"lease": lease}, args={"holder": "a"}) == 1
        assert redis.get(lease) is None
    finally:
        redis.delete(lease)


@pytest.mark.parametrize("value", [None, float("nan")])
def test_what_lua_would_misread_is_refused_before_redis(value: float | None) -> None:
    """JSON's null reaches Lua as cjson.null, a value that is true, not nil: an argument without a
    value is left out, and one given None (or NaN, which is no JSON) is refused."""
    with pytest.raises(ValueError):
        script_call({}, {"x": value})
