"""An in-process pipeline: the real `StageRuntime` of every stage, over the tiny model and a real
Redis, with stage messages passed in memory instead of through Celery and the lanes (those are
tested by the stack tests). Jobs are written as the API writes them and scheduled as the batcher
schedules them, so the job records, event streams, progress set and in-flight hashes are the real
ones; what the tests drive by hand is the order messages arrive in, and what a stage forgets.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis as redis_lib
import torch
from transformers import AutoTokenizer

from app.batching.recovery import Monitor
from app.core.jobs import JobStatus, Transition, decode_record
from app.core.jobstore import JobStore, Lifetimes
from app.core.keys import Keys
from app.core.outcomes import Outcomes
from app.core.protocol import StepMessage
from app.partitions.layers import LayerRange
from app.partitions.prefix import PrefixCache
from app.workers.main import _pad_id, eos_token_ids, load_partition
from app.workers.stage import StageIdentity, StageRuntime

MODEL = "tiny"


@dataclass
class Pipeline:
    redis: redis_lib.Redis
    keys: Keys
    path: Path
    stages: list[StageRuntime]
    outbox: deque[StepMessage] = field(default_factory=deque)
    delivered: list[StepMessage] = field(default_factory=list)

    # --- jobs, as the API writes them and the batcher schedules them -------------------------------

    def submit(self, prompt_ids: list[int], *, max_tokens: int = 8, **request: Any) -> str:
        job_id = uuid.uuid4().hex
        params = {"max_tokens": max_tokens, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None}
        params.update({"stop": [], "ignore_eos": True, "min_tokens": 0, **request})
        record = {
            "id": job_id,
            "status": str(JobStatus.QUEUED),
            "model": MODEL,
            "tenant": "t",
            "priority": "normal",
            "created_at": repr(time.time()),
            "request": json.dumps(params),
            "prompt_ids": json.dumps(prompt_ids),
            "prompt_tokens": str(len(prompt_ids)),
            "completion_tokens": "0",
            "text": "",
            "attempts": "0",
        }
        self.redis.hset(self.keys.job(job_id), mapping=record)  # type: ignore[arg-type]
        self.redis.expire(self.keys.job(job_id), 600)
        return job_id

    def dispatch(self, job_ids: list[str]) -> str:
        """Schedule `job_ids` as one batch and queue its prefill for stage 0."""
        batch_id = uuid.uuid4().hex
        moves = [
            Transition(j, JobStatus.SCHEDULED, {"batch_id": batch_id, "batch_size": len(job_ids)})
            for j in job_ids
        ]
        JobStore(self.redis, self.keys, ttl_s=600).apply(moves)
        self.redis.hset(self.keys.inflight(MODEL), batch_id, json.dumps(job_ids))
        self.redis.zadd(self.keys.progress(), dict.fromkeys(job_ids, time.time()))
        n = len(self.stages)
        self.outbox.append(
            StepMessage(
                batch_id=batch_id, model=MODEL, stage=0, num_stages=n, kind="prefill", step=0, seq_ids=job_ids
            )
        )
        return batch_id

    # --- the transport, in memory ----------------------------------------------------------------

    def pump(self, *, steps: int | None = None, until: Callable[[], bool] | None = None) -> None:
        """Deliver queued messages in order (each to the stage it is addressed to) until none is left,
        `steps` messages have been delivered, or `until()` holds."""
        delivered = 0
        while self.outbox and (steps is None or delivered < steps) and not (until and until()):
            message = self.outbox.popleft()
            self.delivered.append(message)
            self.stages[message.stage].handle(message)
            delivered += 1

    # --- what a client would see ------------------------------------------------------------------

    def record(self, job_id: str) -> dict[str, str]:
        return decode_record(self.redis.hgetall(self.keys.job(job_id)))

    def queued(self) -> list[str]:
        """The ids of this namespace's jobs that wait to be dispatched (the API made them)."""
        found = [
            k.decode().rsplit(":", 1)[1] for k in self.redis.scan_iter(count=1000, match=self.keys.job("*"))
        ]
        return [j for j in found if self.record(j).get("status") == "queued"]

    def wait_queued(
        self, count: int = 1, *, timeout_s: float = 30.0, alive: Callable[[], bool] = lambda: True
    ) -> list[str]:
        """The queued jobs once there are `count` of them; fewer once `alive()` turns false (the
        request it waits for was answered, an error, before it made them) or `timeout_s` passed."""
        deadline = time.monotonic() + timeout_s
        while True:
            queued = self.queued()
            if len(queued) >= count or time.monotonic() > deadline or not alive():
                return queued
            time.sleep(0.01)

    def tokens(self, job_id: str) -> list[int]:
        entries = self.redis.xrange(self.keys.events(job_id))
        data = [json.loads(f[b"data"]) for _, f in entries if f[b"event"] == b"token"]
        return [int(d["token_id"]) for d in sorted(data, key=lambda d: d["index"])]

    def events(self, job_id: str) -> list[tuple[str, dict[str, Any]]]:
        entries = self.redis.xrange(self.keys.events(job_id))
        return [(f[b"event"].decode(), json.loads(f[b"data"])) for _, f in entries]

    # --- the monitor ------------------------------------------------------------------------------

    def recover_stalled(self) -> dict[str, str]:
        """The batcher's monitor, a stall timeout later, with every stage's worker alive."""
        now = time.time()
        for stage in range(len(self.stages)):
            self.redis.zadd(self.keys.workers(MODEL, stage), {f"w{stage}": now + 60})
        monitor = Monitor(
            self.redis,
            self.keys,
            stall_timeout_s=1.0,
            max_attempts=5,
            ttl_s=600,
            stream_maxlen=1000,
            stages=len(self.stages),
        )
        monitor.pipeline_ready(MODEL, now - 10)  # the workers have been there a while
        return monitor.sweep(now + 5)


def build(
    redis: redis_lib.Redis,
    path: Path,
    *,
    stages: int = 1,
    namespace: str | None = None,
    prefix_cache_mb: int = 0,
    dtype: torch.dtype = torch.float32,
    **runtime: Any,
) -> Pipeline:
    """A pipeline of `stages` in-process stage runtimes over the model at `path` (in `dtype`, on the
    CPU); each stage with a prefix cache of `prefix_cache_mb` (0: none)."""
    keys = Keys(namespace or f"test-{uuid.uuid4().hex[:8]}")
    jobs = JobStore(redis, keys, ttl_s=600)
    tokenizer = AutoTokenizer.from_pretrained(path)
    num_layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    pipeline = Pipeline(redis, keys, path, [])
    for stage in range(stages):
        partition = load_partition(path, LayerRange.even_split(num_layers, stages, stage), "cpu", dtype)
        identity = StageIdentity(
            model=MODEL,
            stage=stage,
            num_stages=stages,
            worker=f"w{stage}",
            shared_queue=keys.stage_queue(MODEL, stage),
            lane=keys.lane(MODEL, stage, f"w{stage}"),
            next_queue=keys.stage_queue(MODEL, stage + 1) if stage + 1 < stages else None,
            first_queue=keys.stage_queue(MODEL, 0),
        )
        pipeline.stages.append(
            StageRuntime(
                identity=identity,
                partition=partition,
                tokenizer=tokenizer if partition.is_last else None,
                jobs=jobs,
                outcomes=Outcomes(redis, keys, jobs, life=Lifetimes(600, 600, 1000)),
                redis=redis,
                keys=keys,
                send=lambda message, _queue: pipeline.outbox.append(message),
                hand_off=lambda message, _lane: pipeline.outbox.append(message),
                eos_ids=eos_token_ids(str(path), partition.config),
                pad_id=_pad_id(partition.config),
                prefixes=PrefixCache(prefix_cache_mb * 2**20) if prefix_cache_mb else None,
                **runtime,
            )
        )
    return pipeline


def reference(path: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens of Hugging Face `generate` for one prompt (what every batch must reproduce)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        min_new_tokens=max_new_tokens,
    )
    return [int(t) for t in out[0, len(prompt_ids) :]]
