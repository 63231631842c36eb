"""Structured outputs: every constrained completion follows its grammar, sampled at temperature 1 by a
tiny random model that has SmolLM2's real tokenizer (49152 tokens, as the engine sees a real model's);
a grammar the engine cannot compile is refused at submit; the official client's `parse` on SmolLM2.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import jsonschema
import pytest
import torch
from fastapi.testclient import TestClient
from pydantic import BaseModel, Field
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from app.api.app import create_app
from app.core.grammar import Grammar, json_schema
from tests.stageharness import Pipeline, build
from tests.tinyapi import forget_keys, forget_namespace, tiny_settings

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "active", "tags", "address"],
    "additionalProperties": False,
}
COLOURS = ["red", "green", "dark blue"]
CODE = r"[0-9]{3}-[a-z]{2}"
# "<|im_start|>user\nName one person as JSON.<|im_end|>\n<|im_start|>assistant\n" in SmolLM2's tokenizer
PROMPT = [1, 4093, 198, 5820, 582, 1055, 347, 20110, 30, 2, 198, 1, 520, 9531, 198]
SEEDS = range(5)


def follows(grammar: Grammar, text: str) -> bool:
    if grammar.kind == "json_schema":
        jsonschema.validate(json.loads(text), json.loads(grammar.text))
        return True
    if grammar.kind == "choice":
        return text in json.loads(grammar.text)
    return re.fullmatch(grammar.text, text) is not None


@pytest.fixture(scope="module")
def smol_tiny(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """Tiny random weights under SmolLM2's own tokenizer files."""
    path = tmp_path_factory.mktemp("smol-tiny") / "smol-tiny"
    path.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (smollm2_dir / name).exists():
            shutil.copy(smollm2_dir / name, path / name)
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).eval().save_pretrained(path)
    return path


@pytest.fixture()
def pipelines(redis) -> Iterator[list[Pipeline]]:  # type: ignore[no-untyped-def]
    made: list[Pipeline] = []
    yield made
    for pipeline in made:
        forget_keys(redis, pipeline.keys.namespace)


def submit(pipeline: Pipeline, grammar: Grammar | None, **request: Any) -> str:
    fields = {"temperature": 1.0, "max_tokens": 96, "ignore_eos": False, **request}
    if grammar is not None:
        fields["grammar"] = grammar.to_dict()
    return pipeline.submit(PROMPT, **fields)


@pytest.mark.parametrize(
    "grammar",
    [json_schema(PERSON), Grammar("choice", json.dumps(COLOURS)), Grammar("regex", CODE)],
    ids=["json_schema", "choice", "regex"],
)
def test_every_constrained_output_follows_its_grammar(redis, smol_tiny, pipelines, grammar):  # type: ignore[no-untyped-def]
    """Sampled at temperature 1, one batch of a job per seed: each ends by itself ("stop", its
    grammar complete) and its text follows the grammar; an unconstrained job in the same batch
    samples as it does alone (its row untouched)."""
    pipeline = build(redis, smol_tiny)
    pipelines.append(pipeline)
    alone = submit(pipeline, None, temperature=0.0, max_tokens=12, ignore_eos=True)
    pipeline.dispatch([alone])
    pipeline.pump()

    jobs = [submit(pipeline, grammar, seed=seed) for seed in SEEDS]
    free = submit(pipeline, None, temperature=0.0, max_tokens=12, ignore_eos=True)
    pipeline.dispatch([*jobs, free])
    pipeline.pump()

    texts = []
    for job in jobs:
        record = pipeline.record(job)
        assert record["status"] == "succeeded", record
        assert record["finish_reason"] == "stop", record
        assert follows(grammar, record["text"]), record["text"]
        texts.append(record["text"])
    assert len(set(texts)) > 1, "temperature 1 over several seeds samples more than one answer"
    assert pipeline.tokens(free) == pipeline.tokens(alone)


def test_a_constrained_job_recovered_partway_replays_its_grammar(redis, smol_tiny, pipelines):  # type: ignore[no-untyped-def]
    """A seeded constrained job whose worker died after 5 tokens, recovered onto a fresh worker (its
    matcher rebuilt from the tokens it had streamed), streams what the uninterrupted run streams."""
    grammar = json_schema(PERSON)
    pipeline = build(redis, smol_tiny)
    pipelines.append(pipeline)
    whole = submit(pipeline, grammar, seed=7)
    pipeline.dispatch([whole])
    pipeline.pump()
    expected = pipeline.tokens(whole)

    interrupted = submit(pipeline, grammar, seed=7)
    pipeline.dispatch([interrupted])
    pipeline.pump(until=lambda: len(pipeline.tokens(interrupted)) >= 5)
    pipeline.outbox.clear()  # the worker died with the batch's next step
    assert pipeline.recover_stalled() == {interrupted: "recovering"}
    fresh = build(redis, smol_tiny, namespace=pipeline.keys.namespace)
    fresh.dispatch([interrupted])
    fresh.pump()

    record = fresh.record(interrupted)
    assert record["status"] == "succeeded" and record["attempts"] == "1", record
    assert fresh.tokens(interrupted) == expected
    assert follows(grammar, record["text"])


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


@pytest.mark.parametrize(
    ("body", "named"),
    [
        (schema_format({"type": "strin"}), "strin"),
        (schema_format({"$ref": "#/nowhere"}), "nowhere"),
        (schema_format({"type": "string", "pattern": "(?<=a)b"}), "look-around"),
        ({"guided_regex": "a(b"}, "unclosed group"),
        ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "undefined_rule"),
        ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_regex and guided_choice"),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ],
)
def test_a_grammar_the_engine_cannot_compile_is_422_naming_the_problem(  # type: ignore[no-untyped-def]
    redis_url, tiny_model, body, named
):
    settings = tiny_settings(redis_url, tiny_model, auth="none")
    messages = [{"role": "user", "content": "hi"}]
    try:
        with TestClient(create_app(settings)) as api:
            answer = api.post("/v1/chat/completions", json={"messages": messages, **body})
    finally:
        forget_namespace(redis_url, settings.namespace)
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert error["code"] == "invalid_request" and named in error["message"], error


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    population_millions: int = Field(ge=0, le=100)
    kind: Literal["capital", "port", "other"]


@pytest.mark.slow
def test_the_official_client_parses_smollm2s_answers(tmp_path, redis_url, smollm2_dir):  # type: ignore[no-untyped-def]
    """`client.beta.chat.completions.parse(response_format=<pydantic model>)` against the stack (in
    process) on SmolLM2 returns a parsed object for every prompt (the three asked at once, so their
    jobs share the batch's steps as concurrent clients' do)."""
    from concurrent.futures import ThreadPoolExecutor

    import openai
    from conftest import SMOLLM2
    from harness import start_harness

    stack = start_harness(tmp_path, redis_url=redis_url, models={SMOLLM2: smollm2_dir}, default_model=SMOLLM2)
    try:
        with (
            openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0, timeout=120) as client,
            ThreadPoolExecutor(3) as pool,
        ):

            def parse(city: str):  # type: ignore[no-untyped-def]
                return client.beta.chat.completions.parse(
                    model=SMOLLM2,
                    messages=[{"role": "user", "content": f"Describe the city of {city} as JSON."}],
                    response_format=City,
                    max_completion_tokens=96,
                    temperature=0,
                )

            answers = list(pool.map(parse, ("Paris", "Tokyo", "Lagos")))
    finally:
        stack.stop()
    for answer in answers:
        assert isinstance(answer.choices[0].message.parsed, City), answer
        assert answer.choices[0].finish_reason == "stop"
