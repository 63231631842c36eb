"""One stage of a model pipeline: run a step over this stage's layers and pass the result on.

`StageRuntime.handle` is called for every stage message, by the Celery task (prefill, from the
stage's shared queue) or by the lane consumer (everything after, see `app.workers.lane`). It does
not know about either: messages go out through the injected `send(message, queue)` (Celery, any
replica of the next stage) and `hand_off(message, lane)` (the replica holding the batch). The
last stage samples, publishes tokens and sends the next decode step back to stage 0 until the
batch is done.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from app.core import metrics
from app.core.errors import ConveyorError, InvalidRequest
from app.core.jobs import JobStatus, Transition
from app.core.jobstore import JobStore
from app.core.keys import BATCH_LOG_MAXLEN, Keys
from app.core.protocol import StepMessage
from app.core.publisher import Publisher, TokenOut
from app.partitions.claimcheck import ClaimCheck
from app.partitions.codecs import CodecSpec, decode_tensor, encode_tensor
from app.partitions.layers import BatchState, StagePartition, left_pad
from app.workers.latency import StepLatency
from app.workers.sampling import SamplingParams, ban_tokens, make_generator, sample, token_seed
from app.workers.textstream import TextStream

log = logging.getLogger(__name__)

Send = Callable[[StepMessage, str], None]


@dataclass
class Sequence:
    """What the last stage tracks for one job while it generates."""

    job_id: str
    batch_id: str  # the batch it was scheduled in: its tokens count only while the job is still there
    params: SamplingParams
    generator: torch.Generator
    max_tokens: int
    text: TextStream
    ignore_eos: bool = False
    min_tokens: int = 0  # end-of-sequence is banned until this many tokens are generated
    generated: int = 0
    finish_reason: str | None = None
    created_at: float | None = None  # unix time of the submit: time to first token, end-to-end latency
    priority: str = "normal"
    last_token_at: float | None = None  # unix time of its previous token: inter-token latency

    def reseed(self) -> None:
        """A seeded job's generator, set for its next token from its seed and that token's index
        (`token_seed`): the same draws whether or not the job was recovered partway."""
        if self.params.seed is not None:
            self.generator.manual_seed(token_seed(self.params.seed, self.generated))


class BatchGone(LookupError):
    """A step for a batch this stage no longer holds (dropped as stale, or held by a replica that
    restarted): its jobs were, or will be, recovered by the monitor; nothing here fails them."""


@dataclass(frozen=True)
class Join:
    """A batch prefilled while another was running, waiting at the last stage to join it."""

    msg: StepMessage
    alive: list[tuple[str, int]]  # (job id, first sampled token) of its unfinished sequences


@dataclass
class StageIdentity:
    model: str
    stage: int
    num_stages: int
    worker: str  # unique per process; names this replica's lane
    shared_queue: str
    lane: str
    next_queue: str | None  # shared queue of stage + 1, None on the last stage
    first_queue: str  # shared queue of stage 0


@dataclass
class StageRuntime:
    identity: StageIdentity
    partition: StagePartition
    tokenizer: Any  # only used on the last stage
    jobs: JobStore
    publisher: Publisher
    redis: Any
    keys: Keys
    send: Send  # Celery: a shared stage queue
    hand_off: Send  # the lane of the replica that holds the batch
    latency: StepLatency | None = None
    codec: CodecSpec = field(default_factory=CodecSpec)  # how hidden states travel to the next stage
    claims: ClaimCheck | None = None  # large tensors go by reference through Redis
    eos_ids: frozenset[int] = frozenset()
    pad_id: int = 0
    continuous: bool = True  # let new batches join running ones at step boundaries
    max_running: int = 64  # sequences in one running batch, joiners included
    # A join pads every row to the longest: rows x positions of the merged batch stays under this,
    # so one long-context job cannot make a running batch's KV cache explode.
    max_kv_positions: int = 65536
    batches: dict[str, BatchState] = field(default_factory=dict)
    # Last stage only: per batch, its sequences, its routes, and the batches waiting to join it.
    sequences: dict[str, dict[str, Sequence]] = field(default_factory=dict)
    routes: dict[str, list[str | None]] = field(default_factory=dict)
    joins: dict[str, list[Join]] = field(default_factory=dict)
    # Runs the urgent work waiting now, between two layers of an ordinary step; the seconds it took
    # (the worker's compute thread, `ComputeThread.yield_to_urgent`). None: steps run uninterrupted.
    preempt: Callable[[], float] | None = None
    # Batches whose prefill is running (an urgent prefill may run inside it): not yet join hosts.
    prefilling: set[str] = field(default_factory=set)
    # A batch not stepped for this long lost a stage (its jobs were recovered elsewhere): forget it.
    stale_after_s: float = 120.0
    touched: dict[str, float] = field(default_factory=dict)

    def handle(self, msg: StepMessage) -> None:
        """Run one stage message. One bad batch fails its jobs; the worker keeps serving."""
        now = time.monotonic()
        for batch_id in [b for b, t in self.touched.items() if now - t > self.stale_after_s]:
            log.warning(
                "batch %s: no step for %.0f s, dropping its state", batch_id, now - self.touched[batch_id]
            )
            self._forget(batch_id)
        if msg.kind != "release":
            self.touched[msg.batch_id] = now
        if msg.kind == "release":
            for batch_id in (msg.batch_id, *msg.merge):
                self._drop(batch_id)
            return
        try:
            self._step(msg)
        except BatchGone as gone:
            log.warning("batch %s step %d on stage %d: %s", msg.batch_id, msg.step, self.identity.stage, gone)
            self._abandon(msg)
        except Exception as exc:  # the worker's error boundary
            log.exception("batch %s step %d failed on stage %d", msg.batch_id, msg.step, self.identity.stage)
            self._fail(msg, exc)

    def _step(self, msg: StepMessage) -> None:
        if self.claims is not None:
            msg = msg.forward(tensors=self.claims.get_all(msg.tensors))
        if msg.kind == "prefill":
            msg, state, x = self._begin(msg)
            if not msg.seq_ids:
                self._finish_batch(msg)
                return
            self.prefilling.add(msg.batch_id)
        else:
            state = self._resume(msg)
            x = decode_tensor(msg.tensors["input_ids" if self.partition.is_first else "hidden"])
        try:
            out, took = self._run_layers(state, x)
            metrics.PARTITION_LATENCY.labels(self.identity.model, str(self.identity.stage)).observe(took)
            if self.latency is not None:
                self.latency.observe(took)
            if self.partition.is_last:
                self._sample(msg, out)
            else:
                self._forward(msg, state, out)
        finally:
            self.prefilling.discard(msg.batch_id)

    def _run_layers(self, state: BatchState, x: torch.Tensor) -> tuple[torch.Tensor, float]:
        """This stage's layers over one step, and the seconds they took (urgent work run between
        two of them, for other batches, not counted)."""
        preempt, lent = self.preempt, 0.0

        def between_layers() -> None:
            nonlocal lent
            if preempt is not None:
                lent += preempt()

        started = time.perf_counter()
        out = self.partition(state, x, between_layers if preempt is not None else None)
        return out, time.perf_counter() - started - lent

    def _resume(self, msg: StepMessage) -> BatchState:
        """Decode: drop finished rows, append the rows of joining batches, make room for one token."""
        missing = [b for b in (msg.batch_id, *msg.merge) if b not in self.batches]
        if missing:
            raise BatchGone(f"this stage holds no state for batch {', '.join(missing)}")
        state = self.batches[msg.batch_id]
        joining = [self.batches.pop(batch_id) for batch_id in msg.merge]
        for batch_id in msg.merge:
            self.touched.pop(batch_id, None)
        for part in (state, *joining):
            mine = set(part.seq_ids)
            part.keep([s for s in msg.seq_ids if s in mine])
        for other in joining:
            state.absorb(other)
        if state.seq_ids != msg.seq_ids:
            raise RuntimeError(f"batch {msg.batch_id}: rows out of step with the message")
        state.extend(1)
        return state

    def _begin(self, msg: StepMessage) -> tuple[StepMessage, BatchState, torch.Tensor]:
        """Prefill: build this stage's state for a new batch."""
        routes = list(msg.routes) or [None] * msg.num_stages
        routes[self.identity.stage] = self.identity.lane
        if self.partition.is_first:
            # A job cancelled meanwhile, or rescheduled into another batch (this message being a
            # late redelivery), drops out.
            moves = [Transition(j, JobStatus.RUNNING, when={"batch_id": msg.batch_id}) for j in msg.seq_ids]
            started = set(self.jobs.apply(moves, strict=False))
            seq_ids = [j for j in msg.seq_ids if j in started]
            msg = msg.forward(seq_ids=seq_ids, routes=routes)
            if not seq_ids:
                return msg, BatchState(self.partition.config, [], torch.zeros(0, 0)), torch.zeros(0)
            self.jobs.progressed(seq_ids, time.time())
            records = self.jobs.get_many(seq_ids, "prompt_ids", "attempts")
            x, mask = left_pad(
                [self._input_ids(j, r) for j, r in zip(seq_ids, records, strict=True)], self.pad_id
            )
        else:
            msg = msg.forward(routes=routes)
            x = decode_tensor(msg.tensors["hidden"]).to(self.partition.hidden_dtype)
            mask = decode_tensor(msg.tensors["attention_mask"]).long()
        state = BatchState(self.partition.config, msg.seq_ids, mask)
        state.batch_ids = {msg.batch_id}
        self.batches[msg.batch_id] = state
        if self.partition.is_last:
            self.sequences[msg.batch_id] = self._load_sequences(msg.batch_id, msg.seq_ids)
            self.routes[msg.batch_id] = msg.routes
        return msg, state, x

    def _input_ids(self, job_id: str, record: dict[str, str]) -> list[int]:
        """The prompt; for a recovered job, the prompt and the tokens it had already streamed."""
        ids: list[int] = json.loads(record["prompt_ids"])
        if int(record.get("attempts", "0")):
            ids += self.publisher.emitted(job_id)
        return ids

    def _load_sequences(self, batch_id: str, job_ids: list[str]) -> dict[str, Sequence]:
        """The batch's sequences. A job whose stored request cannot be run (sampling values out of
        bounds, a broken record) fails alone and is left out: `_sample` skips its row."""
        sequences = {}
        records = self.jobs.get_many(job_ids, "request", "attempts", "created_at", "priority")
        for job_id, record in zip(job_ids, records, strict=True):
            try:
                sequences[job_id] = self._sequence(batch_id, job_id, record)
            except Exception as exc:  # this job's error boundary: the rest of the batch goes on
                self._fail_row(job_id, exc)
        return sequences

    def _sequence(self, batch_id: str, job_id: str, record: dict[str, str]) -> Sequence:
        request = json.loads(record["request"])
        params = SamplingParams(
            temperature=request["temperature"],
            top_p=request["top_p"],
            top_k=request["top_k"],
            seed=request.get("seed"),
        )
        problem = params.problem()
        if problem is not None:
            raise InvalidRequest(problem)
        seq = Sequence(
            job_id=job_id,
            batch_id=batch_id,
            params=params,
            generator=make_generator(params),
            max_tokens=request["max_tokens"],
            text=TextStream(self.tokenizer, request.get("stop") or []),
            ignore_eos=bool(request.get("ignore_eos")),
            min_tokens=int(request.get("min_tokens") or 0),
            created_at=float(record["created_at"]) if record.get("created_at") else None,
            priority=record.get("priority") or "normal",
        )
        if int(record.get("attempts", "0")):  # recovered: carry on from what was streamed
            for token in self.publisher.emitted(job_id):
                seq.text.push(token)
                seq.generated += 1
        return seq

    def _forward(self, msg: StepMessage, state: BatchState, hidden: torch.Tensor) -> None:
        tensors = {"hidden": self.codec.encode(hidden)}  # [B, S, D]
        if msg.kind == "prefill":
            tensors["attention_mask"] = encode_tensor(state.attention_mask.to(torch.int8))
        if self.claims is not None:
            tensors = self.claims.put_all(tensors)
        nxt = msg.forward(stage=msg.stage + 1, tensors=tensors)
        lane = nxt.routes[nxt.stage] if nxt.kind == "decode" else None
        if lane:
            self.hand_off(nxt, lane)
        else:
            self.send(nxt, self.identity.next_queue or "")

    def _sample(self, msg: StepMessage, logits: torch.Tensor) -> None:
        sequences = self.sequences[msg.batch_id]
        # A job that failed alone (`_fail_row`) is no longer in `sequences`: its row is skipped.
        index = [i for i, j in enumerate(msg.seq_ids) if j in sequences]
        logits = logits.float().cpu()[index]  # [B', V]: sampling runs on the CPU, per-sequence generators
        candidates = [sequences[msg.seq_ids[i]] for i in index]
        held = [self.eos_ids if s.generated < s.min_tokens else frozenset() for s in candidates]
        for seq in candidates:
            seq.reseed()
        logits = ban_tokens(logits, held)  # min_tokens: no end of sequence yet
        sampled = self._sample_rows(logits, candidates)
        for seq, token in sampled:
            if token is None:
                del sequences[seq.job_id]
        rows = [seq for seq, token in sampled if token is not None]
        tokens = [token for _, token in sampled if token is not None]
        outs = [self._advance(seq, token) for seq, token in zip(rows, tokens, strict=True)]
        gone = self.publisher.tokens(outs)  # cancelled, or recovered elsewhere: these rows leave now
        self._observe(rows, outs, gone)
        alive = [
            (s.job_id, t)
            for s, t in zip(rows, tokens, strict=True)
            if s.finish_reason is None and s.job_id not in gone
        ]
        for seq in rows:
            if seq.finish_reason is not None or seq.job_id in gone:
                del sequences[seq.job_id]
        if msg.kind == "prefill" and alive and self._join_running(msg, alive):
            return
        if msg.kind == "prefill" and self.continuous:
            # Prefilled: the batch no longer takes one of the pipeline's prefill slots; its
            # sequences count against the pipeline's sequence budget (the progress set) instead.
            self._notify_done(msg.model, msg.batch_id)
        self._continue(msg, alive)

    def _sample_rows(self, logits: torch.Tensor, rows: list[Sequence]) -> list[tuple[Sequence, int | None]]:
        """Each row's next token; None for a row whose sampling raised (that job failed alone)."""
        try:
            tokens = sample(logits, [s.params for s in rows], [s.generator for s in rows]).tolist()
            return list(zip(rows, tokens, strict=True))
        except Exception:
            log.exception("sampling a batch of %d failed; sampling its rows one by one", len(rows))
        sampled: list[tuple[Sequence, int | None]] = []
        for i, seq in enumerate(rows):
            try:
                sampled.append((seq, int(sample(logits[i : i + 1], [seq.params], [seq.generator])[0])))
            except Exception as exc:
                self._fail_row(seq.job_id, exc)
                sampled.append((seq, None))
        return sampled

    def _fail_row(self, job_id: str, exc: Exception) -> None:
        """Fail one job of a batch; the batch goes on without it (its row leaves at the next step)."""
        log.warning(
            "job %s failed alone on stage %d: %s: %s", job_id, self.identity.stage, type(exc).__name__, exc
        )
        code = exc.code if isinstance(exc, ConveyorError) else "worker_error"
        message = exc.message if isinstance(exc, ConveyorError) else f"{type(exc).__name__}: {exc}"
        failed = self.publisher.fail(
            [job_id], code=code, message=f"stage {self.identity.stage} could not run this job: {message}"
        )
        metrics.job_ended(self.identity.model, "failed", code, failed)

    def _observe(self, rows: list[Sequence], outs: list[TokenOut], gone: set[str]) -> None:
        """Metrics of one sampled step: first tokens, gaps between tokens, jobs that ended."""
        now, model = time.time(), self.identity.model
        emitted = 0
        for seq, out in zip(rows, outs, strict=True):
            if seq.job_id in gone:
                continue
            if out.emit:
                emitted += 1
                if out.index == 0 and seq.created_at is not None:
                    metrics.TTFT.labels(model, seq.priority).observe(max(0.0, now - seq.created_at))
                elif seq.last_token_at is not None:
                    metrics.INTER_TOKEN.labels(model).observe(now - seq.last_token_at)
                seq.last_token_at = now
            if out.finish_reason is not None:
                metrics.job_ended(model, "succeeded", out.finish_reason)
                if seq.created_at is not None:
                    metrics.JOB_LATENCY.labels(model, seq.priority).observe(max(0.0, now - seq.created_at))
        if emitted:
            metrics.TOKENS.labels(model).inc(emitted)

    def _join_running(self, msg: StepMessage, alive: list[tuple[str, int]]) -> bool:
        """Park a just-prefilled batch on a running one (Orca's iteration-level batching)."""
        host = self._host_for(msg, len(alive))
        if host is None:
            return False
        self.joins.setdefault(host, []).append(Join(msg, alive))
        self._notify_done(msg.model, msg.batch_id)  # it no longer takes a prefill slot
        self.redis.xadd(
            self.keys.batch_log(),
            {"batch_id": msg.batch_id, "model": msg.model, "size": len(alive), "joined": host},
            maxlen=BATCH_LOG_MAXLEN,
            approximate=True,
        )
        return True

    def _host_for(self, msg: StepMessage, size: int) -> str | None:
        """The smallest running batch on the same replicas with room, if the pipeline stays full.

        A pipeline of N stages needs N batches circulating to keep every stage busy, so a new batch
        joins another only when at least N others run on its replicas (they hold its KV cache).
        """
        if not self.continuous:
            return None
        waiting = {join.msg.batch_id for joins in self.joins.values() for join in joins}
        sizes = {
            batch_id: len(self.sequences[batch_id]) + sum(len(j.alive) for j in self.joins.get(batch_id, []))
            for batch_id, routes in self.routes.items()
            if batch_id != msg.batch_id
            and batch_id not in waiting
            and batch_id not in self.prefilling  # it may itself join another, leaving us behind
            and routes == msg.routes
        }
        if len(sizes) < msg.num_stages:
            return None
        host = min(sizes, key=lambda batch_id: sizes[batch_id])
        if sizes[host] + size > self.max_running:
            return None
        fits = self.merged_positions(host, msg.batch_id, sizes[host] + size) <= self.max_kv_positions
        return host if fits else None

    def merged_positions(self, host: str, joiner: str, rows: int) -> int:
        """KV positions of `host` once `joiner` (and the batches already waiting to join it) are in:
        every row padded to the longest of them, plus the step about to be taken."""
        parts = [host, joiner, *(j.msg.batch_id for j in self.joins.get(host, []))]
        longest = max(self.batches[b].attention_mask.shape[-1] for b in parts if b in self.batches)
        return rows * (longest + 1)

    def _continue(self, msg: StepMessage, alive: list[tuple[str, int]]) -> None:
        """Send the next decode step of this batch, with any batches that join it now."""
        joins = self.joins.pop(msg.batch_id, [])
        sequences = self.sequences[msg.batch_id]
        for join in joins:
            sequences.update(self.sequences.pop(join.msg.batch_id))
            self.routes.pop(join.msg.batch_id, None)
            alive = alive + join.alive
        if not alive:
            self._finish_batch(msg)
            return
        ids = torch.tensor([t for _, t in alive], dtype=torch.long)[:, None]  # [B', 1]
        nxt = msg.forward(
            stage=0,
            kind="decode",
            step=msg.step + 1,
            seq_ids=[j for j, _ in alive],
            tensors={"input_ids": encode_tensor(ids)},
            merge=[join.msg.batch_id for join in joins],
        )
        if nxt.routes[0]:
            self.hand_off(nxt, nxt.routes[0])
        else:
            self.send(nxt, self.identity.first_queue)

    def _advance(self, seq: Sequence, token: int) -> TokenOut:
        """Account one sampled token to its sequence and decide whether the sequence ends."""
        index = seq.generated
        if token in self.eos_ids and not seq.ignore_eos:
            seq.finish_reason = "stop"
            tail = seq.text.finish()
            return TokenOut(
                seq.job_id, seq.batch_id, index, token, tail, seq.text.released, "stop", emit=bool(tail)
            )
        seq.generated += 1
        text = seq.text.push(token)
        if seq.text.stopped:
            seq.finish_reason = "stop"
        elif seq.generated >= seq.max_tokens:
            seq.finish_reason = "length"
            text += seq.text.finish()
        return TokenOut(seq.job_id, seq.batch_id, index, token, text, seq.text.released, seq.finish_reason)

    def _finish_batch(self, msg: StepMessage) -> None:
        """The batch is over here: free its state on every other stage and tell the batcher."""
        for stage, lane in enumerate(msg.routes):
            if lane and stage != self.identity.stage:
                self.hand_off(msg.forward(stage=stage, kind="release", seq_ids=[], tensors={}), lane)
        for batch_id in (msg.batch_id, *msg.merge):
            self._drop(batch_id)
        self._notify_done(msg.model, msg.batch_id)

    def _notify_done(self, model: str, batch_id: str) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.hdel(self.keys.inflight(model), batch_id)
        pipe.xadd(
            self.keys.control(),
            {"type": "batch_done", "model": model, "batch_id": batch_id},
            maxlen=1000,
            approximate=True,
        )
        pipe.execute()

    def _fail(self, msg: StepMessage, exc: Exception) -> None:
        """Fail the jobs this batch still holds. A job recovered meanwhile (re-queued, or scheduled
        into another batch) has left it: its record names another batch, or no longer a running
        one, and it is not failed here."""
        state = self.batches.get(msg.batch_id)
        owned = {msg.batch_id, *msg.merge} | (state.batch_ids if state is not None else set())
        job_ids = list(dict.fromkeys([*msg.seq_ids, *(state.seq_ids if state is not None else [])]))
        records = self.jobs.get_many(job_ids, "status", "batch_id") if job_ids else []
        mine = {
            job_id: {"batch_id": r["batch_id"], "status": r["status"]}
            for job_id, r in zip(job_ids, records, strict=True)
            if r.get("batch_id") in owned and r.get("status") in (JobStatus.SCHEDULED, JobStatus.RUNNING)
        }
        failed = self.publisher.fail(
            list(mine),
            code="worker_error",
            message=f"stage {self.identity.stage} failed: {type(exc).__name__}: {exc}",
            when=mine,
        )
        metrics.job_ended(self.identity.model, "failed", "worker_error", failed)
        self._finish_batch(msg)

    def _abandon(self, msg: StepMessage) -> None:
        """Let go of a batch this stage cannot step: the other stages free its state and its slot is
        given back; its jobs, no longer progressing, are recovered by the monitor, not failed."""
        for batch_id in (msg.batch_id, *msg.merge):
            self._forget(batch_id)
        for stage, lane in enumerate(msg.routes):
            if lane and stage != self.identity.stage:
                self.hand_off(msg.forward(stage=stage, kind="release", seq_ids=[], tensors={}), lane)
        self._notify_done(msg.model, msg.batch_id)

    def _forget(self, batch_id: str) -> None:
        self.batches.pop(batch_id, None)
        self.sequences.pop(batch_id, None)
        self.routes.pop(batch_id, None)
        self.touched.pop(batch_id, None)
        for join in self.joins.pop(batch_id, []):
            self._forget(join.msg.batch_id)

    def _drop(self, batch_id: str) -> None:
        self.batches.pop(batch_id, None)
        self.sequences.pop(batch_id, None)
        self.routes.pop(batch_id, None)
        self.touched.pop(batch_id, None)
        for join in self.joins.pop(batch_id, []):  # the host is gone: the joiner goes on alone
            self._continue(join.msg, join.alive)
