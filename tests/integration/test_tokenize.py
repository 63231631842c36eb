"""/tokenize and /detokenize as vLLM answers them: the model's own token ids (its chat template for
messages), a round trip back to the text, credentials like every endpoint, 4xx for bad input."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from transformers import AutoConfig, AutoTokenizer

from app.api.app import create_app
from app.api.auth import key_digest, new_api_key
from tests.tinyapi import forget_namespace, tiny_settings

KEY = new_api_key()


@pytest.fixture()
def client(redis_url: str, tiny_model: Path) -> Iterator[TestClient]:
    settings = tiny_settings(redis_url, tiny_model, api_keys={key_digest(KEY): "acme"})
    try:
        with TestClient(create_app(settings), headers={"Authorization": f"Bearer {KEY}"}) as test_client:
            yield test_client
    finally:
        forget_namespace(redis_url, settings.namespace)


def test_a_prompt_and_messages_are_the_models_token_ids(client: TestClient, tiny_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    answer = client.post("/tokenize", json={"model": "tiny", "prompt": "The quick brown fox"})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["tokens"] == tokenizer("The quick brown fox").input_ids
    assert body["count"] == len(body["tokens"]) > 0
    assert body["max_model_len"] == AutoConfig.from_pretrained(tiny_model).max_position_embeddings

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.post("/tokenize", json={"messages": messages}).json()  # the default model
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert chat["tokens"] == tokenizer(text, add_special_tokens=False).input_ids
    plain = client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert plain["count"] < chat["count"], "without the assistant's turn the rendering is shorter"

    back = client.post("/detokenize", json={"model": "tiny", "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": tokenizer.decode(body["tokens"])}
    assert "quick brown fox" in back.json()["prompt"]


def test_refusals(client: TestClient) -> None:
    unknown = client.post("/tokenize", json={"model": "no-such-model", "prompt": "hi"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    assert client.post("/detokenize", json={"model": "nope", "tokens": [1]}).status_code == 404
    bad = client.post("/detokenize", json={"tokens": [1, -1, 10**9]})
    assert bad.status_code == 422 and bad.json()["error"]["details"]["invalid"] == [-1, 10**9]
    for body in ({}, {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, {"tokens": ["x"]}):
        assert client.post("/tokenize", json=body).status_code == 422
    assert client.post("/detokenize", json={"tokens": "x"}).status_code == 422
    huge = client.post("/tokenize", json={"prompt": "x" * (512 * 16 + 1)})  # more than 512 tokens can hold
    assert huge.status_code == 422 and huge.json()["error"]["code"] == "context_length_exceeded"
    anonymous = client.post("/tokenize", json={"prompt": "hi"}, headers={"Authorization": ""})
    assert anonymous.status_code == 401
