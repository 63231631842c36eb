"""The request fields benchmark tools send (guidellm, aiperf: vLLM's `ignore_eos`, `min_tokens`,
`stream_options.continuous_usage_stats`, `stop: null`, `max_completion_tokens`), on a tiny model whose
end-of-sequence token is the greedy choice: without `ignore_eos` these prompts end at once."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from clients import events, submit, tokens, wait
from harness import start_harness
from transformers import AutoModelForCausalLM, AutoTokenizer

from app.api.catalog import ModelInfo

PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
# As guidellm sends a chat message: a list of text parts.
PARTS = [{"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]}]


@pytest.fixture(scope="module")
def eos_model(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Path:
    """The tiny model, with end-of-sequence ids that include the greedy first token after PROMPT
    and after the chat of MESSAGES (each encoded as the API encodes it)."""
    path = tmp_path_factory.mktemp("eos") / "eos"
    shutil.copytree(tiny_model, path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    info = ModelInfo("eos", path, tokenizer, 512)
    with torch.no_grad():
        firsts = {
            int(model(torch.tensor([ids])).logits[0, -1].argmax())
            for ids in (info.encode_prompt(PROMPT), info.encode_chat(MESSAGES))
        }
    eos = sorted(firsts | {tokenizer.eos_token_id})
    for name in ("config.json", "generation_config.json"):
        config = json.loads((path / name).read_text())
        config["eos_token_id"] = eos
        (path / name).write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def eos_stack(tmp_path_factory, redis_url, eos_model):  # type: ignore[no-untyped-def]
    stack = start_harness(
        tmp_path_factory.mktemp("eos-stack"),
        redis_url=redis_url,
        models={"eos": eos_model},
        default_model="eos",
        extra_env={"CONVEYOR_TORCH_THREADS": "1"},
    )
    yield stack
    stack.stop()


def chunks_of(client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:  # type: ignore[no-untyped-def]
    with client.stream("POST", path, json=body) as answer:
        assert answer.status_code == 200, answer.read()
        lines = [line for line in answer.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def assert_counts_so_far(chunks: list[dict[str, Any]], max_tokens: int) -> None:
    """continuous_usage_stats: every chunk's usage, never decreasing, the last ones the total."""
    usages = [c["usage"] for c in chunks]
    assert all(u is not None for u in usages), "every chunk carries the usage"
    counts = [u["completion_tokens"] for u in usages]
    assert counts == sorted(counts) and counts[-1] == max_tokens
    assert len({u["prompt_tokens"] for u in usages}) == 1 and usages[0]["prompt_tokens"] > 0
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
    *_, last, usage = chunks
    assert last["choices"][0]["finish_reason"] == "length" and usage["choices"] == []


def test_eos_is_the_greedy_choice_so_a_plain_request_ends_at_once(eos_stack):  # type: ignore[no-untyped-def]
    with eos_stack.client() as client:
        answer = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 16, "temperature": 0})
        chat = client.post(
            "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 16, "temperature": 0}
        )
    assert (
        answer.json()["usage"]["completion_tokens"] == 0
        and answer.json()["choices"][0]["finish_reason"] == "stop"
    )
    assert (
        chat.json()["usage"]["completion_tokens"] == 0
        and chat.json()["choices"][0]["finish_reason"] == "stop"
    )


def test_a_guidellm_completions_body_generates_max_tokens(eos_stack):  # type: ignore[no-untyped-def]
    body = {
        "model": "eos",
        "prompt": PROMPT,
        "max_tokens": 64,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "ignore_eos": True,
        "stop": None,
    }
    with eos_stack.client() as client:
        chunks = chunks_of(client, "/v1/completions", body)
    assert_counts_so_far(chunks, 64)
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) != ""


def test_a_guidellm_chat_body_generates_max_completion_tokens(eos_stack):  # type: ignore[no-untyped-def]
    body = {
        "model": "eos",
        "messages": PARTS,
        "max_completion_tokens": 48,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "ignore_eos": True,
        "stop": None,
    }
    with eos_stack.client() as client:
        chunks = chunks_of(client, "/v1/chat/completions", body)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[0]["usage"]["completion_tokens"] == 0
    assert_counts_so_far(chunks, 48)


def test_max_completion_tokens_wins_over_max_tokens(eos_stack):  # type: ignore[no-untyped-def]
    body = {"messages": MESSAGES, "max_tokens": 5, "max_completion_tokens": 7, "ignore_eos": True}
    with eos_stack.client() as client:
        answer = client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 7


def test_continuous_usage_stats_needs_include_usage(eos_stack):  # type: ignore[no-untyped-def]
    body = {
        "prompt": PROMPT,
        "max_tokens": 6,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"continuous_usage_stats": True},
    }
    with eos_stack.client() as client:
        chunks = chunks_of(client, "/v1/completions", body)
    assert all(c["usage"] is None for c in chunks), "as vLLM reads it: no usage unless include_usage"


def test_min_tokens_holds_eos_back_as_generate_min_new_tokens_does(eos_stack, eos_model):  # type: ignore[no-untyped-def]
    tokenizer = AutoTokenizer.from_pretrained(eos_model)
    model = AutoModelForCausalLM.from_pretrained(eos_model).eval()
    ids = torch.tensor([tokenizer(PROMPT).input_ids])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=40, min_new_tokens=5
    )[0, ids.shape[1] :].tolist()
    eos = set(model.generation_config.eos_token_id)
    want = out[: next((i for i, t in enumerate(out) if t in eos), len(out))]
    with eos_stack.client() as client:
        job = submit(client, prompt=PROMPT, max_tokens=40, min_tokens=5, temperature=0)
        stream = events(client, job["urls"]["events"])
        got = [e.data["token_id"] for e in tokens(stream)]
        done = wait(client, job["id"])
    assert got == want and len(got) >= 5
    assert done["usage"]["completion_tokens"] == len(got)
    assert done["finish_reason"] == ("length" if len(got) == 40 else "stop")
    with openai.OpenAI(base_url=eos_stack.url + "/v1", api_key="x", max_retries=0, timeout=60) as oai:
        answer = oai.completions.create(
            model="eos", prompt=PROMPT, max_tokens=40, temperature=0, extra_body={"min_tokens": 5}
        )
    assert answer.choices[0].text == done["text"]


@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/completions"])
def test_min_tokens_over_max_tokens_is_422(eos_stack, path):  # type: ignore[no-untyped-def]
    with eos_stack.client() as client:
        answer = client.post(path, json={"prompt": PROMPT, "max_tokens": 4, "min_tokens": 5})
    assert answer.status_code == 422
    error = answer.json()["error"]
    assert "min_tokens is 5, over max_tokens (4)" in error["message"] and error["details"]["limit"] == 4


def test_bookkeeping_fields_are_accepted_and_answer_changing_ones_refused(eos_stack):  # type: ignore[no-untyped-def]
    accepted = {
        "user": "u-1",
        "metadata": {"run": "7"},
        "store": False,
        "service_tier": "auto",
        "length_penalty": 1.0,  # the neutral value of a refused field
        "stream_options": {"include_usage": True, "include_obfuscation": False},
        "stream": True,
    }
    with eos_stack.client() as client:
        body = {"messages": MESSAGES, "max_tokens": 3, "ignore_eos": True, **accepted}
        assert chunks_of(client, "/v1/chat/completions", body)[-1]["usage"]["completion_tokens"] == 3
        for field, value in (("length_penalty", 1.3), ("use_beam_search", True), ("prompt_logprobs", 1)):
            answer = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, field: value})
            assert answer.status_code == 422, field
            assert field in answer.json()["error"]["message"]
