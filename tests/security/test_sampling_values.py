"""Poison sampling values: refused at the API with the field named, harmless inside `sample()`, and a
job stored with them anyway (written straight into Redis, past the API) fails alone while the jobs
batched with it succeed."""

from __future__ import annotations

import json
import time
import uuid

import pytest
import redis as redis_lib
import torch
from clients import wait

from app.core.keys import Keys
from app.workers.sampling import SamplingParams, make_generator, sample

POISON = [
    ("temperature", 1e-300),
    ("temperature", 0.001),
    ("top_p", 1e-50),
    ("top_p", 0.0),
    ("top_k", 2**63),
    ("top_k", 2**31),
]


@pytest.mark.parametrize(("field", "value"), POISON)
@pytest.mark.parametrize("endpoint", ["/v1/jobs", "/v1/completions", "/v1/chat/completions"])
def test_poison_values_are_refused_with_the_field_named(stack, endpoint, field, value):  # type: ignore[no-untyped-def]
    body: dict[str, object] = {"max_tokens": 1, field: value}
    if endpoint == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    with stack.client() as client:
        answer = client.post(endpoint, json=body)
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert error["code"] == "invalid_request"
    assert field in error["message"]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1e-300),
        SamplingParams(top_p=1e-50),
        SamplingParams(top_k=2**63),
        SamplingParams(top_k=2**70),
        SamplingParams(top_k=-3),
        SamplingParams(temperature=float("nan")),
        SamplingParams(temperature=float("inf")),
        SamplingParams(temperature=-1.0),
        SamplingParams(top_p=float("nan")),
        SamplingParams(top_p=0.0),
        SamplingParams(temperature=1e-300, top_p=1e-50, top_k=2**63),
    ],
    ids=repr,
)
def test_sample_never_raises_for_a_rows_values(params: SamplingParams) -> None:
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(0)) * 5
    healthy = SamplingParams(temperature=0.7, seed=1)
    rows = [healthy, params, healthy]
    tokens = sample(logits, rows, [make_generator(p) for p in rows])
    assert tokens.shape == (3,) and all(0 <= t < 64 for t in tokens.tolist())
    alone = sample(logits[:1], [healthy], [make_generator(healthy)])
    assert tokens[0] == alone[0]  # the poisoned row did not disturb its neighbours


def test_sample_survives_non_finite_logits() -> None:
    logits = torch.randn(2, 32)
    logits[1, 3] = float("nan")
    logits[1, 4] = float("inf")
    rows = [SamplingParams(temperature=1.0, seed=0)] * 2
    tokens = sample(logits, rows, [make_generator(p) for p in rows])
    assert all(0 <= t < 32 for t in tokens.tolist())


def _queue_jobs(client: redis_lib.Redis, keys: Keys, requests: list[dict[str, object]]) -> list[str]:
    """Jobs written as the API writes them, in one transaction: the batcher sees them together."""
    ids = [uuid.uuid4().hex for _ in requests]
    pipe = client.pipeline(transaction=True)
    for job_id, request in zip(ids, requests, strict=True):
        prompt_ids = [40, 41, 42, 43]
        pipe.hset(
            keys.job(job_id),
            mapping={
                "id": job_id,
                "status": "queued",
                "model": "tiny",
                "tenant": "anonymous",
                "priority": "normal",
                "created_at": repr(time.time()),
                "request": json.dumps(request),
                "prompt_ids": json.dumps(prompt_ids),
                "prompt_tokens": str(len(prompt_ids)),
                "completion_tokens": "0",
                "text": "",
                "attempts": "0",
            },
        )
        pipe.expire(keys.job(job_id), 600)
        pipe.xadd(
            keys.intake("normal"),
            {"job_id": job_id, "model": "tiny", "prompt_tokens": str(len(prompt_ids)), "priority": "normal"},
        )
    pipe.execute()
    return ids


def test_a_poisoned_row_fails_alone_and_its_batch_goes_on(stack, redis):  # type: ignore[no-untyped-def]
    healthy = {"max_tokens": 6, "temperature": 0.8, "top_p": 0.9, "top_k": 0, "seed": 7, "stop": []}
    poison = {**healthy, "temperature": 1e-300, "top_p": 1e-50, "top_k": 2**63}
    ids = _queue_jobs(redis, Keys(stack.namespace), [healthy, poison, healthy, healthy])
    with stack.client() as client:
        jobs = [wait(client, job_id) for job_id in ids]
    bad = jobs[1]
    assert bad["status"] == "failed", bad
    assert bad["error"]["code"] == "invalid_request" and "temperature" in bad["error"]["message"]
    for job in jobs[:1] + jobs[2:]:
        assert job["status"] == "succeeded", job
        assert job["usage"]["completion_tokens"] >= 1
    # They ran in one batch: the poisoned row was there, and only it failed.
    assert len({job["batch"]["id"] for job in jobs}) == 1, [job["batch"] for job in jobs]
