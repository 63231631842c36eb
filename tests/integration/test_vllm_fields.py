"""vLLM's extra request fields on the OpenAI endpoints: each one the API accepts changes the prompt or
the job as vLLM specifies, or is refused with 422 naming it; none is silently ignored. The API runs in
process over a tiny model whose tokenizer adds a BOS token and whose chat template reads a variable;
no worker runs, so each job stays queued and its record shows what the request became."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
from fastapi.testclient import TestClient
from tokenizers import processors
from transformers import AutoTokenizer

from app.api.app import create_app
from app.core.keys import Keys
from tests.tiny import CHAT_TEMPLATE, make_tokenizer
from tests.tinyapi import forget_namespace, tiny_settings

TEMPLATE = CHAT_TEMPLATE + "{% if enable_thinking is defined and enable_thinking %}<think>\n{% endif %}"
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def fields_model(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Path:
    """The tiny model; its tokenizer starts every prompt with `<|im_start|>` (a BOS), and its chat
    template adds `<think>` when `enable_thinking` is set."""
    path = tmp_path_factory.mktemp("fields") / "fields"
    shutil.copytree(tiny_model, path)
    tokenizer = make_tokenizer()
    bos = tokenizer.convert_tokens_to_ids("<|im_start|>")
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)]
    )
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture()
def api(redis_url: str, fields_model: Path) -> Iterator[tuple[TestClient, Keys, redis_lib.Redis]]:
    settings = tiny_settings(redis_url, fields_model, auth="none")
    keys, redis = Keys(settings.namespace), redis_lib.Redis.from_url(redis_url)
    redis.zadd(keys.workers("tiny", 0), {"w0": time.time() + 600})  # a live stage worker: jobs queue
    try:
        with TestClient(create_app(settings)) as client:
            client.app.state.jobs.sync_timeout_s = 0.05  # type: ignore[attr-defined]
            yield client, keys, redis
    finally:
        forget_namespace(redis_url, settings.namespace)


def queued(api: tuple[TestClient, Keys, redis_lib.Redis], path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The job a request became: its prompt's token ids and its stored request."""
    client, keys, redis = api
    answer = client.post(path, json={"max_tokens": 2, **body})
    assert answer.status_code == 504, answer.text  # no worker: the job waits in the queue
    record = redis.hgetall(keys.job(answer.json()["error"]["details"]["job_id"]))
    return {"prompt_ids": json.loads(record[b"prompt_ids"]), "request": json.loads(record[b"request"])}


def chat_text(api: tuple[TestClient, Keys, redis_lib.Redis], fields_model: Path, **fields: Any) -> str:
    ids = queued(api, "/v1/chat/completions", {"messages": MESSAGES, **fields})["prompt_ids"]
    return str(AutoTokenizer.from_pretrained(fields_model).decode(ids))


def test_add_generation_prompt_false_leaves_the_assistant_turn_unopened(api, fields_model):  # type: ignore[no-untyped-def]
    assert chat_text(api, fields_model) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert chat_text(api, fields_model, add_generation_prompt=False) == "<|im_start|>user\nHi<|im_end|>\n"


def test_continue_final_message_leaves_the_last_message_open(api, fields_model):  # type: ignore[no-untyped-def]
    messages = [*MESSAGES, {"role": "assistant", "content": "Hello the"}]
    text = chat_text(
        api, fields_model, messages=messages, add_generation_prompt=False, continue_final_message=True
    )
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello the"


def test_chat_template_kwargs_reach_the_template(api, fields_model):  # type: ignore[no-untyped-def]
    text = chat_text(api, fields_model, chat_template_kwargs={"enable_thinking": True})
    assert text.endswith("<|im_start|>assistant\n<think>\n")


def test_add_special_tokens_as_vllm_defaults_it(api, fields_model):  # type: ignore[no-untyped-def]
    tokenizer = AutoTokenizer.from_pretrained(fields_model)
    bos = tokenizer.convert_tokens_to_ids("<|im_start|>")
    plain = tokenizer("abc", add_special_tokens=False).input_ids
    assert queued(api, "/v1/completions", {"prompt": "abc"})["prompt_ids"] == [bos, *plain]
    assert (
        queued(api, "/v1/completions", {"prompt": "abc", "add_special_tokens": False})["prompt_ids"] == plain
    )
    assert chat_text(api, fields_model).count("<|im_start|>") == 2  # the template's own, no BOS added
    assert chat_text(api, fields_model, add_special_tokens=True).count("<|im_start|>") == 3


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(api, fields_model):  # type: ignore[no-untyped-def]
    whole = queued(api, "/v1/completions", {"prompt": "abcdefghij"})["prompt_ids"]
    cut = queued(api, "/v1/completions", {"prompt": "abcdefghij", "truncate_prompt_tokens": 4})
    assert cut["prompt_ids"] == whole[-4:]
    chat = queued(api, "/v1/chat/completions", {"messages": MESSAGES, "truncate_prompt_tokens": 3})
    assert len(chat["prompt_ids"]) == 3


def test_skip_special_tokens_false_travels_with_the_job(api):  # type: ignore[no-untyped-def]
    assert "skip_special_tokens" not in queued(api, "/v1/completions", {"prompt": "a"})["request"]
    job = queued(api, "/v1/completions", {"prompt": "a", "skip_special_tokens": False})
    assert job["request"]["skip_special_tokens"] is False


REFUSED = [
    ("chat_template", "{{ messages }}"),
    ("prompt_logprobs", 1),
    ("spaces_between_special_tokens", False),
    ("documents", [{"title": "t", "text": "x"}]),
    ("mm_processor_kwargs", {"a": 1}),
    ("logits_processors", ["my.Processor"]),
    ("vllm_xargs", {"a": 1}),
    ("kv_transfer_params", {"a": 1}),
    ("prompt_embeds", "AAAA"),
    ("structural_tag", "{}"),
    ("guided_decoding_backend", "xgrammar"),
    ("guided_whitespace_pattern", " "),
    ("truncate_prompt_tokens", 0),
    ("skip_special_tokens", "sometimes"),
    ("chat_template_kwargs", {"tokenize": True}),
    ("chat_template_kwargs", {"add_generation_prompt": False}),
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(("field", "value"), REFUSED, ids=[f"{f}={v!r}"[:40] for f, v in REFUSED])
def test_a_field_not_implemented_is_refused_with_its_name(api, path, field, value):  # type: ignore[no-untyped-def]
    body = {"prompt": "a"} if path == "/v1/completions" else {"messages": MESSAGES}
    answer = api[0].post(path, json={"max_tokens": 2, **body, field: value})
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert error["code"] == "invalid_request" and error["type"] == "invalid_request_error"
    assert field in error["message"]


@pytest.mark.parametrize(
    ("field", "value"),
    [("add_generation_prompt", False), ("continue_final_message", True), ("chat_template_kwargs", {"x": 1})],
)
def test_chat_fields_are_refused_on_completions(api, field, value):  # type: ignore[no-untyped-def]
    answer = api[0].post("/v1/completions", json={"prompt": "a", "max_tokens": 2, field: value})
    assert answer.status_code == 422 and field in answer.json()["error"]["message"]


def test_continue_final_message_with_a_generation_prompt_is_refused(api):  # type: ignore[no-untyped-def]
    body = {"messages": MESSAGES, "max_tokens": 2, "continue_final_message": True}
    answer = api[0].post("/v1/chat/completions", json=body)
    assert answer.status_code == 422 and "add_generation_prompt" in answer.json()["error"]["message"]


def test_neutral_values_of_refused_fields_are_accepted(api):  # type: ignore[no-untyped-def]
    neutral = {"bad_words": [], "return_token_ids": False, "spaces_between_special_tokens": True}
    queued(api, "/v1/completions", {"prompt": "a", "chat_template": None, "prompt_logprobs": None, **neutral})


BAD_CONTROLS = [
    ("logit_bias", {"100000": 1.0}),
    ("logit_bias", {"5": 101.0}),
    ("logit_bias", {"five": 1.0}),
    ("allowed_token_ids", []),
    ("allowed_token_ids", [3, 100000]),
    ("stop_token_ids", [-1]),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", 11.0),
    ("presence_penalty", 2.5),
    ("frequency_penalty", -3.0),
    ("min_p", 1.5),
    ("bad_words", [""]),
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/jobs"])
@pytest.mark.parametrize(("field", "value"), BAD_CONTROLS, ids=[f"{f}={v!r}" for f, v in BAD_CONTROLS])
def test_a_sampling_control_out_of_range_is_refused_with_its_name(api, path, field, value):  # type: ignore[no-untyped-def]
    body = {"messages": MESSAGES} if path == "/v1/chat/completions" else {"prompt": "a"}
    answer = api[0].post(path, json={"max_tokens": 2, **body, field: value})
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"]["code"] == "invalid_request" and field in answer.json()["error"]["message"]


def test_sampling_controls_travel_with_the_job_as_vllm_reads_them(api, fields_model):  # type: ignore[no-untyped-def]
    tokenizer = AutoTokenizer.from_pretrained(fields_model)
    body = {
        "prompt": "a",
        "presence_penalty": 0.5,
        "frequency_penalty": -0.25,
        "repetition_penalty": 1.2,
        "min_p": 0.1,
        "logit_bias": {"7": -100, "3": 2.5},
        "allowed_token_ids": [3, 7, 9],
        "stop_token_ids": [5],
        "bad_words": ["ab"],
    }
    request = queued(api, "/v1/completions", body)["request"]
    assert request["presence_penalty"] == 0.5 and request["frequency_penalty"] == -0.25
    assert request["repetition_penalty"] == 1.2 and request["min_p"] == 0.1
    assert request["logit_bias"] == [[3, 2.5], [7, -100.0]]
    assert request["allowed_token_ids"] == [3, 7, 9] and request["stop_token_ids"] == [5]
    bare = tokenizer("ab", add_special_tokens=False).input_ids
    spaced = tokenizer(" ab", add_special_tokens=False).input_ids
    assert request["bad_words"] == [bare]  # " ab" is three tokens here: not the same word (vLLM's rule)
    assert len(spaced) != len(bare)
    plain = queued(api, "/v1/completions", {"prompt": "a"})["request"]
    assert set(plain) == {
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "ignore_eos",
        "min_tokens",
    }


GENERATION_DEFAULTS = {"temperature": 0.6, "top_p": 0.9, "top_k": 7, "repetition_penalty": 1.1, "min_p": 0.05}


@pytest.fixture()
def defaults_api(redis_url, fields_model, tmp_path):  # type: ignore[no-untyped-def]
    """The API over a copy of the model whose generation_config.json sets sampling defaults (and one
    value no request may send, which is not used)."""
    path = tmp_path / "defaults"
    shutil.copytree(fields_model, path)
    config = json.loads((path / "generation_config.json").read_text())
    config |= GENERATION_DEFAULTS | {"top_p": 1e-9}  # below MIN_TOP_P: left out
    (path / "generation_config.json").write_text(json.dumps(config))
    settings = tiny_settings(redis_url, path, auth="none")
    keys, redis = Keys(settings.namespace), redis_lib.Redis.from_url(redis_url)
    redis.zadd(keys.workers("tiny", 0), {"w0": time.time() + 600})
    try:
        with TestClient(create_app(settings)) as client:
            client.app.state.jobs.sync_timeout_s = 0.05  # type: ignore[attr-defined]
            yield client, keys, redis
    finally:
        forget_namespace(redis_url, settings.namespace)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/jobs"])
def test_left_out_sampling_values_are_the_models_generation_config(defaults_api, path):  # type: ignore[no-untyped-def]
    body = {"messages": MESSAGES} if path == "/v1/chat/completions" else {"prompt": "a"}
    if path == "/v1/jobs":
        client, keys, redis = defaults_api
        answer = client.post(path, json={"max_tokens": 2, **body})
        assert answer.status_code == 202, answer.text
        request = json.loads(redis.hget(keys.job(answer.json()["id"]), "request"))
    else:
        request = queued(defaults_api, path, body)["request"]
    assert {k: request[k] for k in GENERATION_DEFAULTS} == GENERATION_DEFAULTS | {"top_p": 1.0}
    explicit = {"temperature": 0, "top_p": 0.5, "top_k": 0, "repetition_penalty": 1.0, "min_p": 0.0}
    if path != "/v1/jobs":
        request = queued(defaults_api, path, {**body, **explicit})["request"]
        assert {k: request.get(k, 1.0 if k == "repetition_penalty" else 0.0) for k in explicit} == explicit


def test_a_model_without_sampling_defaults_samples_as_vllm_does(api):  # type: ignore[no-untyped-def]
    request = queued(api, "/v1/completions", {"prompt": "a"})["request"]
    assert (request["temperature"], request["top_p"], request["top_k"]) == (1.0, 1.0, 0)
    assert "repetition_penalty" not in request and "min_p" not in request


def test_a_prompt_job_takes_the_chat_fields_defaults_on_every_route(api):  # type: ignore[no-untyped-def]
    client = api[0]
    assert client.post("/v1/inference", json={"prompt": "a", "max_tokens": 2}).status_code == 504  # queued
    refused = client.post("/v1/jobs", json={"prompt": "a", "add_generation_prompt": False})
    assert refused.status_code == 422 and "add_generation_prompt" in refused.json()["error"]["message"]
