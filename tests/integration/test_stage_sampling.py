"""vLLM's sampling controls through the last stage (the in-process pipeline over the tiny model, fp32,
greedy), each job of one batch against a greedy loop over the same model with transformers' logits
processors: each control gives the reference's tokens, and the job without one is untouched."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LogitsProcessor,
    NoBadWordsLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from tests.stageharness import Pipeline, build
from tests.tinyapi import forget_keys
from tests.unit.test_sampling_controls import OutputPenalties

PROMPT = [37, 41, 40, 76, 51, 115, 69, 62]  # greedy repeats a prompt token and one of its own
STEPS = 8
# processors(prompt_len) -> what a row's logits go through; `output_only`: the processor sees the
# generated tokens alone (vLLM matches bad words against the output).
Reference = tuple[Callable[[], list[LogitsProcessor]], bool]


@pytest.fixture()
def pipeline(redis, tiny_model):  # type: ignore[no-untyped-def]
    made = build(redis, tiny_model, stages=1)
    yield made
    forget_keys(redis, made.keys.namespace)


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


def greedy(model: Any, processors: list[LogitsProcessor], *, output_only: bool = False) -> list[int]:
    ids = list(PROMPT)
    for _ in range(STEPS):
        with torch.no_grad():
            scores = model(torch.tensor([ids])).logits[:, -1].float()
        seen = torch.tensor([ids[len(PROMPT) :] if output_only else ids])
        for processor in processors:
            scores = processor(seen, scores)
        ids.append(int(scores.argmax()))
    return ids[len(PROMPT) :]


def run(pipeline: Pipeline, requests: list[dict[str, Any]]) -> list[str]:
    jobs = [pipeline.submit(PROMPT, max_tokens=STEPS, **request) for request in requests]
    pipeline.dispatch(jobs)
    pipeline.pump()
    for job in jobs:
        assert pipeline.record(job)["status"] == "succeeded", pipeline.record(job)
    return jobs


def test_each_control_in_one_batch_matches_transformers(pipeline, model):  # type: ignore[no-untyped-def]
    plain = greedy(model, [])
    cases: list[tuple[dict[str, Any], list[LogitsProcessor], bool]] = [
        ({}, [], False),
        ({"repetition_penalty": 2.0}, [RepetitionPenaltyLogitsProcessor(2.0)], False),
        (
            {"presence_penalty": 1.5, "frequency_penalty": 0.7},
            [OutputPenalties(len(PROMPT), presence=1.5, frequency=0.7)],
            False,
        ),
        (
            {"logit_bias": [[plain[1], -100.0], [7, 2.5]]},
            [SequenceBiasLogitsProcessor([[[plain[1]], -100.0], [[7], 2.5]])],
            False,
        ),
        (
            {"allowed_token_ids": [50, 51, 52, 60]},
            [PrefixConstrainedLogitsProcessor(lambda _b, _i: [50, 51, 52, 60], num_beams=1)],
            False,
        ),
        (
            {"bad_words": [[plain[2]], [plain[0], plain[1]]]},
            [NoBadWordsLogitsProcessor([[plain[2]], [plain[0], plain[1]]], eos_token_id=0)],
            True,
        ),
        (
            {"repetition_penalty": 1.3, "logit_bias": [[9, 1.0]], "presence_penalty": 0.5},
            [
                SequenceBiasLogitsProcessor([[[9], 1.0]]),
                RepetitionPenaltyLogitsProcessor(1.3),
                OutputPenalties(len(PROMPT), presence=0.5, frequency=0.0),
            ],
            False,
        ),
    ]
    jobs = run(pipeline, [request for request, _, _ in cases])
    for job, (request, processors, output_only) in zip(jobs, cases, strict=True):
        want = greedy(model, processors, output_only=output_only)
        assert pipeline.tokens(job) == want, request
        if request:
            assert want != plain, f"{request} changes nothing here: the case proves nothing"


def test_stop_token_ids_end_the_output_and_min_tokens_holds_them_back(pipeline, model):  # type: ignore[no-untyped-def]
    plain = greedy(model, [])
    stop = plain[3]
    assert stop not in plain[:3]
    first, held = run(pipeline, [{"stop_token_ids": [stop]}, {"stop_token_ids": [stop], "min_tokens": 6}])
    assert pipeline.tokens(first) == plain[:3]
    record = pipeline.record(first)
    assert record["finish_reason"] == "stop" and record["completion_tokens"] == "3"

    class HoldStop(LogitsProcessor):
        def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
            if input_ids.shape[1] - len(PROMPT) < 6:
                scores[:, stop] = float("-inf")
            return scores

    want = greedy(model, [HoldStop()])
    want = want[: want.index(stop)] if stop in want else want
    assert pipeline.tokens(held) == want and len(want) >= 6


def test_skip_special_tokens_false_keeps_them_in_the_text(pipeline, tiny_model):  # type: ignore[no-untyped-def]
    special = AutoTokenizer.from_pretrained(tiny_model).convert_tokens_to_ids("<|im_start|>")
    forced = {"logit_bias": [[special, 100.0]]}
    skipped, kept = run(pipeline, [forced, {**forced, "skip_special_tokens": False}])
    assert pipeline.tokens(kept) == [special] * STEPS
    assert pipeline.record(skipped)["text"] == ""
    assert pipeline.record(kept)["text"] == "<|im_start|>" * STEPS


def test_logprobs_are_the_models_log_softmax_at_each_token(pipeline, model):  # type: ignore[no-untyped-def]
    """Greedy and sampled (with a penalty and a temperature, which the logprobs do not see: vLLM's raw
    logprobs), each token's log probability and its top 5 as the model's own log-softmax gives them,
    and a job that asked for none carries none."""
    requests = [
        {"logprobs": 5},
        {"logprobs": 0, "temperature": 0.8, "seed": 3, "repetition_penalty": 1.5},
        {},
    ]
    greedy_job, sampled_job, plain_job = run(pipeline, requests)
    for job, k in ((greedy_job, 5), (sampled_job, 0)):
        tokens = pipeline.tokens(job)
        ids = torch.tensor([PROMPT + tokens])
        with torch.no_grad():
            reference = model(ids).logits[0, len(PROMPT) - 1 : -1].float().log_softmax(dim=-1)  # [T, V]
        events = [data for kind, data in pipeline.events(job) if kind == "token"]
        assert [e["token_id"] for e in events] == tokens
        for event, row, token in zip(events, reference, tokens, strict=True):
            assert abs(event["logprob"] - float(row[token])) < 1e-3
            values, top_ids = row.topk(k)
            assert [t for t, _ in event["top_logprobs"]] == top_ids.tolist()
            assert all(
                abs(lp - float(v)) < 1e-3 for (_, lp), v in zip(event["top_logprobs"], values, strict=True)
            )
    assert all("logprob" not in data for kind, data in pipeline.events(plain_job) if kind == "token")
