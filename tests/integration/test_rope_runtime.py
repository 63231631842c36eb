"""A longrope model (Phi-3.5's shape) through the real stage runtimes in process (tests/stageharness.py):
jobs that grow past `original_max_position_embeddings` while they decode, in one batch and in a batch
that joins it, across two stages, stream what `generate` gives for each prompt alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers as tf
from tiny import make_tokenizer

from tests.stageharness import Pipeline, build, reference
from tests.tinyapi import forget_keys

LIMIT = 24


@pytest.fixture(scope="module")
def phi35(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = make_tokenizer()
    half = 8  # head_dim 16
    config = tf.Phi3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4 * LIMIT,
        original_max_position_embeddings=LIMIT,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.1 * i for i in range(half)],
            "long_factor": [2.0 + 0.5 * i for i in range(half)],
            "original_max_position_embeddings": LIMIT,
        },
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        initializer_range=0.5,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("longrope") / "phi35"
    tf.Phi3ForCausalLM(config).eval().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture()
def pipelines(redis):  # type: ignore[no-untyped-def]
    made: list[Pipeline] = []
    yield made
    for pipeline in made:
        forget_keys(redis, pipeline.keys.namespace)


def test_jobs_growing_past_the_original_length_stream_what_generate_gives(redis, phi35, pipelines):  # type: ignore[no-untyped-def]
    pipeline = build(redis, phi35, stages=2, prefix_cache_mb=16)
    pipelines.append(pipeline)
    prompts = [[5 + i for i in range(10)], [40 + i for i in range(20)], [90 + i for i in range(LIMIT)]]
    first = [pipeline.submit(p, max_tokens=18) for p in prompts[:2]]
    pipeline.dispatch(first)
    pipeline.pump(steps=5)  # the batch runs; the next one is prefilled and joins it
    joining = pipeline.submit(prompts[2], max_tokens=18)
    pipeline.dispatch([joining])
    pipeline.pump()
    for job, prompt in zip([*first, joining], prompts, strict=True):
        assert pipeline.record(job)["status"] == "succeeded", pipeline.record(job)
        assert pipeline.tokens(job) == reference(phi35, prompt, 18)
