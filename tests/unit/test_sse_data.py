"""An event's JSON stays one SSE line for every client: the characters JSON leaves as they are but
line readers such as Python's `str.splitlines` (httpx's `iter_lines`) break on are escaped."""

from __future__ import annotations

import json

from app.api.routes.jobs import sse_data


def test_line_separators_in_generated_text_are_escaped_and_the_value_is_unchanged() -> None:
    text = json.dumps({"text": "a\u2028b\x85c\u2029d\n"}, ensure_ascii=False)
    safe = sse_data(text)
    assert len(safe.splitlines()) == 1
    assert json.loads(safe) == json.loads(text)
