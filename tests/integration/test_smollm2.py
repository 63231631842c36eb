"""The real model through the pipeline: greedy tokens equal `model.generate` for a batch."""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from clients import events, submit, tokens
from conftest import SMOLLM2
from harness import start_harness
from transformers import AutoModelForCausalLM, AutoTokenizer

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "Write one sentence about the sea, mentioning waves, wind, salt and the colour of the sky at dusk.",
    "2+2=?",
]


@functools.cache
def reference(path: Path) -> tuple[list[list[int]], int]:
    """`generate`'s greedy tokens for each question alone (end-of-sequence left out), and the model's
    parameter bytes: computed once for both stage counts."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    expected = []
    for question in QUESTIONS:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        ids = torch.tensor([tokenizer(text, add_special_tokens=False).input_ids])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24)
        expected.append([t for t in out[0, ids.shape[1] :].tolist() if t != tokenizer.eos_token_id])
    return expected, sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.slow
@pytest.mark.parametrize("stages", [1, 2])
def test_smollm2_greedy_batch_equals_generate(tmp_path, redis_url, smollm2_dir, stages):  # type: ignore[no-untyped-def]
    expected, whole = reference(smollm2_dir)
    stack = start_harness(
        tmp_path,
        redis_url=redis_url,
        models={SMOLLM2: smollm2_dir},
        default_model=SMOLLM2,
        extra_env={"CONVEYOR_STAGES": str(stages)},
    )
    try:
        with stack.client() as client, ThreadPoolExecutor(len(QUESTIONS)) as pool:
            with stack.held():  # submitted together, whatever the machine's load: one round takes them
                jobs = [
                    submit(client, messages=[{"role": "user", "content": q}], max_tokens=24, temperature=0)
                    for q in QUESTIONS
                ]
            streams = list(pool.map(lambda job: events(client, job["urls"]["events"]), jobs))
            served = client.get("/readyz").json()["checks"]["stages"]
    finally:
        stack.stop()
    for question, stream, want in zip(QUESTIONS, streams, expected, strict=True):
        assert stream[-1].data["status"] == "succeeded"
        assert [e.data["token_id"] for e in tokens(stream)] == want, question
    assert max(s[-1].data["batch"]["size"] for s in streams) > 1
    held = [info["param_bytes"] for info in served.values()]  # what each stage worker holds
    assert len(held) == stages
    if stages > 1:  # each worker holds only its partition: cut by compute, stage 0 holds the
        # embedding and 19 of the 30 layers (0.71x of the model), stage 1 the other 11 and the head
        assert max(held) <= 0.72 * whole, (held, whole)


@pytest.mark.slow
def test_smollm2_in_bf16_through_the_stack_answers_paris(tmp_path, redis_url, smollm2_dir):  # type: ignore[no-untyped-def]
    """The bf16 stack end to end (2 stages, bf16 hand-offs); /readyz says the dtype."""
    stack = start_harness(
        tmp_path,
        redis_url=redis_url,
        models={SMOLLM2: smollm2_dir},
        default_model=SMOLLM2,
        extra_env={"CONVEYOR_STAGES": "2", "CONVEYOR_DTYPE": "bfloat16"},
    )
    try:
        with stack.client() as client:
            job = submit(
                client, messages=[{"role": "user", "content": QUESTIONS[0]}], max_tokens=24, temperature=0
            )
            stream = events(client, job["urls"]["events"])
            served = client.get("/readyz").json()["checks"]["stages"]
    finally:
        stack.stop()
    assert stream[-1].data["status"] == "succeeded"
    assert "Paris" in stream[-1].data["text"]
    assert {info["dtype"] for info in served.values()} == {"bfloat16"}
    assert sorted(info["stage"] for info in served.values()) == [0, 1]
