"""The stage worker of a one-stage pipeline on the step engine (`CONVEYOR_ENGINE=step`, or `auto`
on a CPU: `app.workers.main.engine_of`).

The batcher's windows arrive as they do for every stage worker (a prefill message per batch, from
the stage's queue); here they only *admit* their jobs: each becomes a sequence of the engine loop's
scheduler (`EngineLoop`), which from then on alone decides what every step runs: decode rows of the
running sequences and chunks of the waiting prompts, ragged, over a paged KV cache. No batch runs
inside another, no decode step goes through a lane, nothing joins or is padded.

It is the stage runtime (`StageRuntime`) for everything around the model: reading jobs, their
sampling rules, grammars and stop strings, publishing tokens, failing a job alone, metrics. A batch
is reported done to the batcher (`Outcomes.batch_done`) once each of its jobs has its first token
or has left, as a prefilled batch is on the batch engine; from then its jobs count against the
pipeline's sequence budget.

Echo's prompt logprobs: a job that asks for them computes its whole prompt (no cached blocks,
`Seq.reuse`); the final hidden states of its prompt's chunks are kept as the steps run them, and
on its first token they go through the model's norm and head (`app.workers.echo`).

Credit: the replica advertises what it may still take (`app.core.credit`) whenever that changes,
after an admission or a step; the batcher sends windows against it.

Threads: admissions run on the compute thread as urgent items, so they run between two steps;
`pump` is the ordinary item that runs steps while there is work (`Pump` starts it when an
admission brings work to an idle loop).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from app.core import metrics
from app.core.credit import RECEIVED, ReplicaCredit
from app.core.jobs import JobStatus, Transition
from app.core.keys import PRIORITIES
from app.core.protocol import StepMessage
from app.core.steps import Steps
from app.workers import echo
from app.workers.decode import Sequence, advance
from app.workers.engine.loop import EngineLoop
from app.workers.engine.scheduler import SchedulerConfig, Seq, StepPlan
from app.workers.stage import StageRuntime

log = logging.getLogger(__name__)

BLOCK_SIZE = 16  # as the prefix cache's blocks (`app.partitions.digest.BLOCK`)
PROGRESS_EVERY_S = 2.0  # waiting sequences' stall clocks restarted this often (the monitor's)
CREDIT_REFRESH_S = 30.0  # an unchanged credit is said again this often (its key lives 10 x heartbeat_ttl_s)

# A prompt, and the final hidden states of its chunks run so far, by first position.
Echo = tuple[tuple[int, ...], dict[int, torch.Tensor]]


def scheduler_config(
    *, kv_positions: int, max_running: int, step_tokens: int, caching: bool = True
) -> SchedulerConfig:
    """The engine's budgets from the worker's settings: the KV cache of `kv_positions` positions in
    blocks, `max_running` sequences, `step_tokens` tokens a step (at least one per sequence); with
    `caching`, whole computed blocks are kept for later prompts that start with them."""
    return SchedulerConfig(
        num_blocks=max(1, kv_positions // BLOCK_SIZE),
        block_size=BLOCK_SIZE,
        max_num_seqs=max_running,
        max_num_batched_tokens=max(step_tokens, max_running),
        prefix_caching=caching,
    )


@dataclass
class EngineRuntime(StageRuntime):
    """A one-stage pipeline's worker on the step engine (see the module's docstring)."""

    engine: SchedulerConfig | None = None
    advertise: Callable[[ReplicaCredit], None] | None = None  # where its credit goes (the batcher's)
    loop: EngineLoop = field(init=False)
    rows: dict[str, Sequence] = field(init=False, default_factory=dict)  # running jobs' sampling state
    batch_of: dict[str, str] = field(init=False, default_factory=dict)  # job -> batch, until its first token
    waits: dict[str, set[str]] = field(init=False, default_factory=dict)  # batch -> jobs without a token yet
    # job -> its prompt and the final hidden states of the prompt's chunks run so far, by first
    # position (echo's prompt logprobs), until its first token
    echoes: dict[str, Echo] = field(init=False, default_factory=dict)
    wake: threading.Event = field(init=False, default_factory=threading.Event)
    received: deque[str] = field(init=False, default_factory=lambda: deque(maxlen=RECEIVED))  # batches
    _progressed_at: float = field(init=False, default=0.0)
    _counted: set[str] = field(init=False, default_factory=set)  # jobs whose cached prompt is counted
    _advertised: ReplicaCredit | None = field(init=False, default=None)
    _advertised_at: float = field(init=False, default=0.0)
    _advertising: threading.Lock = field(init=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if not (self.partition.is_first and self.partition.is_last):
            raise ValueError(
                "the step engine serves one-stage pipelines; CONVEYOR_ENGINE=batch serves the others"
            )
        self.loop = EngineLoop(
            [self.partition],
            self.engine
            or scheduler_config(
                kv_positions=self.max_kv_positions, max_running=self.max_running, step_tokens=512
            ),
        )
        self.advertise_credit()  # from its start: the batcher knows it for a step-engine pipeline

    @property
    def busy(self) -> bool:
        return self.loop.has_work

    def run(self, msg: StepMessage) -> Steps[None]:
        """Admit a batch's jobs (the only message a one-stage engine worker is sent)."""
        if msg.kind != "prefill":
            log.warning("batch %s: a %s message on the step engine, ignored", msg.batch_id, msg.kind)
            return
        try:
            self._admit(msg)
        except Exception as exc:  # the worker's error boundary: this batch fails, the loop goes on
            log.exception("batch %s could not be admitted", msg.batch_id)
            self._fail(msg, exc)
        self.received.append(msg.batch_id)
        self.advertise_credit()
        self.wake.set()
        yield from ()

    def advertise_credit(self) -> None:
        """Tell the batcher what this replica may still take, if that changed since it last did."""
        if self.advertise is None:
            return
        config, credit = self.loop.scheduler.config, self.loop.scheduler.credit()
        offer = ReplicaCredit(
            sequences=credit.sequences,
            blocks=credit.blocks,
            block_size=config.block_size,
            max_sequences=config.max_num_seqs,
            received=tuple(self.received),
        )
        with self._advertising:  # one report at a time: a refresh never says an older one after it
            if offer != self._advertised:
                self._say(offer)

    def refresh_credit(self) -> None:
        """Say an unchanged credit again now and then, so that its key does not expire while idle."""
        with self._advertising:
            offer = self._advertised
            if offer is not None and time.monotonic() - self._advertised_at >= CREDIT_REFRESH_S:
                self._say(offer)

    def _say(self, offer: ReplicaCredit) -> None:
        assert self.advertise is not None  # nothing is said without it (`advertise_credit`)
        try:
            self.advertise(offer)
        except Exception:  # Redis away for a moment: the next change or refresh says it again
            log.warning("the credit of %s could not be advertised", self.identity.model, exc_info=True)
            return
        self._advertised, self._advertised_at = offer, time.monotonic()

    def _admit(self, msg: StepMessage) -> None:
        # A job cancelled meanwhile, or rescheduled into another batch (a late redelivery), drops out.
        moves = [Transition(j, JobStatus.RUNNING, when={"batch_id": msg.batch_id}) for j in msg.seq_ids]
        started = set(self.jobs.apply(moves, strict=False))
        job_ids = [j for j in msg.seq_ids if j in started]
        if not job_ids:
            self.outcomes.batch_done(msg.model, msg.batch_id)
            return
        self.jobs.progressed(job_ids, time.time())
        read = self.jobs.get_many(job_ids)
        sequences = self._load_sequences(msg.batch_id, job_ids, read)  # a broken request fails alone
        records = dict(zip(job_ids, read, strict=True))
        waiting = set()
        for job_id, seq in sequences.items():
            asks = echo.asked({job_id: seq})
            if job_id in self.rows:  # recovered while this loop still held it (it stalled): anew
                self._leave(job_id)
            try:
                rank = PRIORITIES.index(seq.priority) if seq.priority in PRIORITIES else 2
                ids = tuple(self._input_ids(job_id, records[job_id]))
                tokens = max(1, seq.max_tokens - seq.generated)
                self.loop.add(Seq(job_id, ids, tokens, rank=rank, reuse=not asks))
            except Exception as exc:  # too long for the KV cache, or not servable here: alone
                self._fail_row(job_id, exc)
                continue
            if asks:
                self.echoes[job_id] = (ids, {})
            self.rows[job_id] = seq
            self.batch_of[job_id] = msg.batch_id
            waiting.add(job_id)
        if waiting:
            self.waits[msg.batch_id] = waiting
        else:
            self.outcomes.batch_done(msg.model, msg.batch_id)

    def pump(self) -> Steps[None]:
        """Run steps while there is work; admissions (urgent) run between two of them."""
        while self.loop.has_work:
            self.step_once()
            yield

    def step_once(self) -> None:
        """Plan, run, sample and publish one step. A step that raises fails the jobs it held."""
        try:
            self._plan_and_run()
        except Exception as exc:  # the worker's error boundary: the loop's jobs fail, the worker goes on
            log.exception("an engine step of %s failed", self.identity.model)
            held = list(self.rows)
            when = {j: {"batch_id": self.rows[j].batch_id, "status": JobStatus.RUNNING} for j in held}
            try:
                failed = self.outcomes.fail(
                    held,
                    code="worker_error",
                    message=f"the engine step failed: {type(exc).__name__}: {exc}",
                    when=when,
                )
                metrics.job_ended(self.identity.model, "failed", "worker_error", failed)
            except Exception:  # Redis away too: the jobs stay running, and the recovery monitor takes them
                log.exception("the jobs of the failed step could not be failed; they will be recovered")
            for job_id in held:
                self._leave(job_id)
            self.loop.reset()  # the failed step's plan was never applied
        self.advertise_credit()

    def _plan_and_run(self) -> None:
        scheduler = self.loop.scheduler
        plan = scheduler.schedule()
        started = time.perf_counter()
        final: list[torch.Tensor] | None = [] if self.echoes else None
        logits = self.loop.run(plan, final) if plan.rows else torch.zeros(0)
        if final:
            self._keep_prompt_columns(plan, final[0])
        self._count_prompts(plan)
        took = time.perf_counter() - started
        metrics.PARTITION_LATENCY.labels(self.identity.model, str(self.identity.stage)).observe(took)
        if self.latency is not None:
            self.latency.observe(took)
        sampling = [r.seq_id for r in plan.rows if r.samples]
        kept = self._choose([self.rows[j] for j in sampling], logits) if sampling else []
        tokens = dict.fromkeys(sampling, 0) | {seq.job_id: token for seq, token, _ in kept}
        scheduler.update(plan, tokens)
        asking = {seq.job_id for seq, _, _ in kept if seq.job_id in self.echoes}
        echoes = self._prompt_logprobs(sorted(asking))
        kept = [k for k in kept if k[0].job_id in echoes or k[0].job_id not in asking]
        chosen = {seq.job_id for seq, _, _ in kept}
        for job_id in sampling:
            if job_id not in chosen:  # its sampling or its echo failed: failed alone already
                self._leave(job_id)
        outs = echo.attach([advance(seq, token, self.eos_ids, lp) for seq, token, lp in kept], echoes)
        gone = self.outcomes.tokens(outs) if outs else set()
        self._observe([seq for seq, _, _ in kept], outs, gone)
        for seq, _, _ in kept:
            self._first_token(seq.job_id)
            if seq.job_id in gone or seq.finish_reason is not None:
                self._leave(seq.job_id)
        self._keep_waiting_alive()

    def _count_prompts(self, plan: StepPlan) -> None:
        """The prefix cache's metrics, as the batch engine's stages count them: the prompt positions
        of jobs without a first token that this step computed, and, at a job's first row, those its
        cached blocks gave it; the memory the cached blocks hold."""
        computed = reused = 0
        for row in plan.rows:
            if row.seq_id in self.batch_of:  # its prompt is being prefilled
                computed += len(row.tokens)
                if row.seq_id not in self._counted:
                    self._counted.add(row.seq_id)
                    reused += row.start
        if not computed:
            return
        labels = (self.identity.model, str(self.identity.stage))
        metrics.PREFIX_TOKENS.labels(*labels, "cache").inc(reused)
        metrics.PREFIX_TOKENS.labels(*labels, "computed").inc(computed)
        pool, cache = self.loop.scheduler.pool, self.loop.caches[0]
        metrics.PREFIX_CACHE_BYTES.labels(*labels).set(pool.cached_blocks * cache.nbytes() // pool.num_blocks)

    def _keep_prompt_columns(self, plan: StepPlan, hidden: torch.Tensor) -> None:
        """Keep the final hidden states [T, D] of this step's prompt positions of the jobs that
        asked for their prompt's logprobs (positions 0 to L - 2 predict the prompt's tokens)."""
        flat = 0
        for row in plan.rows:
            state = self.echoes.get(row.seq_id)
            if state is not None:
                ids, columns = state
                count = min(row.stop, len(ids) - 1) - row.start
                if count > 0:
                    columns[row.start] = hidden[flat : flat + count].clone()
            flat += len(row.tokens)

    def _prompt_logprobs(self, job_ids: list[str]) -> dict[str, echo.Entries]:
        """The prompt logprobs of `job_ids`, jobs that asked for them and got their first token
        this step. A job whose columns do not cover its prompt fails alone (it is left out)."""
        out: dict[str, echo.Entries] = {}
        for job_id in job_ids:
            ids, columns = self.echoes.pop(job_id)
            try:
                parts, position = [], 0
                while position < len(ids) - 1:  # a recomputed prompt's chunks replace the earlier ones
                    part = columns[position]
                    parts.append(part)
                    position += part.shape[0]
                if not parts:  # a one-token prompt: nothing before its token to predict it
                    out[job_id] = []
                    continue
                top = self.rows[job_id].params.prompt_logprobs or 0
                out[job_id] = echo.prompt_logprobs(self.partition, torch.cat(parts), list(ids), top)
            except Exception as exc:  # a position never run (a bug): this job fails, not the step
                self._fail_row(job_id, exc)
        return out

    def _first_token(self, job_id: str) -> None:
        """A job has its first token (or left): its batch is done once all of its jobs are."""
        self._counted.discard(job_id)
        batch_id = self.batch_of.pop(job_id, None)
        if batch_id is None:
            return
        waiting = self.waits.get(batch_id)
        if waiting is not None:
            waiting.discard(job_id)
            if not waiting:
                del self.waits[batch_id]
                self.outcomes.batch_done(self.identity.model, batch_id)

    def _leave(self, job_id: str) -> None:
        self.loop.abort(job_id)
        self.rows.pop(job_id, None)
        self.echoes.pop(job_id, None)
        self._first_token(job_id)

    def _keep_waiting_alive(self) -> None:
        """Jobs admitted but not yet producing tokens restart their stall clocks now and then: the
        recovery monitor must not take them for lost."""
        now = time.monotonic()
        if now - self._progressed_at < PROGRESS_EVERY_S or not self.batch_of:
            return
        self._progressed_at = now
        self.jobs.progressed(list(self.batch_of), time.time())


class Pump(threading.Thread):
    """Starts the engine's `pump` on the compute thread whenever an admission brings it work."""

    def __init__(self, runtime: EngineRuntime, compute: Any) -> None:
        super().__init__(name="engine-pump", daemon=True)
        self.runtime, self.compute = runtime, compute

    def run(self) -> None:
        while not self.compute.stopping:
            self.runtime.wake.wait(1.0)
            self.runtime.wake.clear()
            self.runtime.refresh_credit()
            if self.runtime.busy and not self.compute.stopping:
                try:
                    self.compute.call(self.runtime.pump)
                except Exception:  # the compute thread stopped meanwhile, or a step's error escaped
                    if self.compute.stopping:
                        return
                    log.exception(
                        "the engine's steps of %s stopped; they start again", self.runtime.identity.model
                    )
