"""A chat of many tiny messages cannot buy seconds of API CPU: a 1 MiB body holds 30,000 empty
messages, each of which used to be converted, rendered by the chat template and tokenized (about
2 s) before the context check refused the result.

- past MAX_CHAT_MESSAGES (app/api/checks.py) a chat is 422 `invalid_request` naming the count,
  before anything is converted or rendered (native and OpenAI routes);
- under it, a chat whose template tokens alone (per message, measured once per model) overflow the
  context is 422 `context_length_exceeded` before it is rendered;
- an ordinary chat is served as before.

The real API app in process over a real Redis, the tiny model (context 512), no workers.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from app.api.app import create_app
from tests.tinyapi import forget_namespace, tiny_settings

EMPTY = {"role": "user", "content": ""}


@pytest.fixture(scope="module")
def client(redis_url: str, tiny_model: Path) -> Iterator[TestClient]:
    settings = tiny_settings(redis_url, tiny_model, auth="none", heartbeat_ttl_s=5e8)  # no stage gate
    try:
        with TestClient(create_app(settings)) as api:
            yield api
    finally:
        forget_namespace(redis_url, settings.namespace)


@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/chat/completions"])
def test_thirty_thousand_empty_messages_are_refused_by_their_count(client, path):  # type: ignore[no-untyped-def]
    answer = client.post(path, json={"model": "tiny", "messages": [EMPTY] * 30_000, "max_tokens": 1})
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert error["code"] == "invalid_request"
    assert error["details"] == {"limit": 1024, "messages": 30_000}


def test_template_tokens_count_against_the_context_before_rendering(client, tiny_model):  # type: ignore[no-untyped-def]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)

    def tokens(chat: list[dict[str, str]]) -> int:
        return len(
            tokenizer(tokenizer.apply_chat_template(chat, tokenize=False), add_special_tokens=False).input_ids
        )

    per_message = tokens([EMPTY, EMPTY]) - tokens([EMPTY])  # the role that costs the fewest
    assert per_message >= 2  # the tiny template wraps each message in its role's markers
    count = 512 // per_message + 1  # under the count cap, over the context in template alone
    for path in ("/v1/jobs", "/v1/chat/completions"):
        answer = client.post(path, json={"model": "tiny", "messages": [EMPTY] * count, "max_tokens": 1})
        assert answer.status_code == 422, answer.text
        error = answer.json()["error"]
        assert error["code"] == "context_length_exceeded"
        assert error["details"]["messages"] == count
        assert error["details"]["template_tokens"] == count * per_message > 512


def test_an_ordinary_chat_is_served(client):  # type: ignore[no-untyped-def]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    answer = client.post("/v1/jobs", json={"messages": messages, "max_tokens": 2})
    assert answer.status_code == 202, answer.text
