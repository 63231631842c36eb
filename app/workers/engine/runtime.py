"""Stage 0's worker of a pipeline on the step engine (`CONVEYOR_ENGINE=step`, or `auto` on a CPU:
`app.workers.main.engine_of`); the later stages' part is `app.workers.engine.stages`.

The batcher's windows arrive as they do for every stage worker (a prefill message per batch, from
stage 0's queue); here they only *admit* their jobs: each becomes a sequence of the engine loop's
scheduler (`EngineLoop`), which from then on alone decides what every step runs: decode rows of the
running sequences and chunks of the waiting prompts, ragged, over paged KV caches. No batch runs
inside another, nothing joins or is padded.

A one-stage pipeline plans, runs, samples and publishes each step here. Stage 0 of several runs its
own layers and sends the plan and its hidden states to a replica of stage 1 (on its lane), which
sends them on; the last stage samples and sends the tokens back. A plan is in flight per stage at
once (while stage 1 runs step n, stage 0 runs step n + 1), the running sequences split into as many
micro-batches; a sequence is in one plan in flight at most. The replica of each later stage is
picked among the live ones (heartbeats) once and kept while it beats (`app.workers.engine.routes`).
When it stops, or a plan is not answered within `stale_after_s`, or the recovery monitor sends
back a job of a plan in flight, the plans in flight are lost: stage 0 lets go of every job it holds
(the recovery monitor runs them again) and picks replicas anew, not the ones that lost them.

It is the stage runtime (`StageRuntime`) for everything around the model: reading jobs, their
sampling rules, grammars and stop strings, publishing tokens, failing a job alone, metrics. A batch
is reported done to the batcher (`Outcomes.batch_done`) once each of its jobs has its first token
or has left, as a prefilled batch is on the batch engine; from then its jobs count against the
pipeline's sequence budget.

Echo's prompt logprobs: a job that asks for them computes its whole prompt (no cached blocks,
`Seq.reuse`); the final hidden states of its prompt's chunks are kept by the last stage as the
steps run them, and on its first token they go through the model's norm and head
(`app.workers.echo`).

Credit: stage 0 advertises what its replica may still take (`app.core.credit`) whenever that
changes, after an admission or a step; the batcher sends windows against it.

Threads: admissions and sampled tokens run on the compute thread as urgent items, so they run
between two steps; `pump` is the ordinary item that runs steps while one can start (`Pump` starts
it when a message brings work to an idle loop).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
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
from app.workers.engine.loop import EngineLoop, layout
from app.workers.engine.routes import CHECK_S, Routes
from app.workers.engine.scheduler import SchedulerConfig, Seq, StepPlan
from app.workers.engine.stages import EngineStage
from app.workers.engine.wire import PlanWire, Sampled

log = logging.getLogger(__name__)

BLOCK_SIZE = 16  # as the prefix cache's blocks (`app.partitions.digest.BLOCK`)
PROGRESS_EVERY_S = 2.0  # waiting sequences' stall clocks restarted this often (the monitor's)
STUCK_S = 0.05  # after a plan with nothing to run, stage 0 waits this long for news before planning again
CREDIT_REFRESH_S = 30.0  # an unchanged credit is said again this often (its key lives 10 x heartbeat_ttl_s)


def scheduler_config(
    *, kv_positions: int, max_running: int, step_tokens: int, caching: bool = True, depth: int = 1
) -> SchedulerConfig:
    """The engine's budgets from the worker's settings: the KV cache of `kv_positions` positions in
    blocks, `max_running` sequences, `step_tokens` tokens a step (at least one per sequence); with
    `caching`, whole computed blocks are kept for later prompts that start with them; `depth` plans
    in flight at once (a pipeline's stages)."""
    return SchedulerConfig(
        num_blocks=max(1, kv_positions // BLOCK_SIZE),
        block_size=BLOCK_SIZE,
        max_num_seqs=max_running,
        max_num_batched_tokens=max(step_tokens, max_running),
        prefix_caching=caching,
        max_in_flight=depth,
    )


@dataclass
class Flight:
    """A plan stage 0 sent down the pipeline, until its sampled tokens come back."""

    plan: StepPlan
    group: int  # its micro-batch: which decode slab each stage reads for it
    sent_at: float


@dataclass
class EngineRuntime(EngineStage):
    """A stage worker of a pipeline on the step engine (see the module's docstring)."""

    engine: SchedulerConfig | None = None
    advertise: Callable[[ReplicaCredit], None] | None = None  # where its credit goes (the batcher's)
    loop: EngineLoop | None = field(init=False, default=None)  # stage 0's
    batch_of: dict[str, str] = field(init=False, default_factory=dict)  # job -> batch, until its first token
    waits: dict[str, set[str]] = field(init=False, default_factory=dict)  # batch -> jobs without a token yet
    wake: threading.Event = field(init=False, default_factory=threading.Event)
    received: deque[str] = field(init=False, default_factory=lambda: deque(maxlen=RECEIVED))  # batches
    # stage 0 of several: the plans down the pipeline, oldest first; the lanes of the later stages'
    # replicas it sends to (and their workers); the jobs the last stage has not seen yet, and those
    # it let go of since its last step
    flights: deque[Flight] = field(init=False, default_factory=deque)
    routes: Routes = field(init=False)
    _unseen: dict[str, str] = field(init=False, default_factory=dict)
    _gone: list[str] = field(init=False, default_factory=list)
    _epoch: int = field(init=False, default=0)
    _stuck_until: float = field(init=False, default=0.0)  # the last plan had no rows: wait for news
    _progressed_at: float = field(init=False, default=0.0)
    _counted: set[str] = field(init=False, default_factory=set)  # jobs whose cached prompt is counted
    _advertised: ReplicaCredit | None = field(init=False, default=None)
    _advertised_at: float = field(init=False, default=0.0)
    _advertising: threading.Lock = field(init=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        identity = self.identity
        self.routes = Routes(
            self.redis, self.keys, identity.model, identity.num_stages, identity.worker, self.heartbeat_ttl_s
        )
        if not self.partition.is_first:
            return
        self.loop = EngineLoop(
            [self.partition],
            self.engine
            or scheduler_config(
                kv_positions=self.max_kv_positions,
                max_running=self.max_running,
                step_tokens=512,
                depth=self.identity.num_stages,
            ),
        )
        self.advertise_credit()  # from its start: the batcher knows it for a step-engine pipeline

    @property
    def head(self) -> EngineLoop:
        """Stage 0's loop (only stage 0 plans steps)."""
        if self.loop is None:
            raise RuntimeError("only a pipeline's stage 0 plans steps")
        return self.loop

    @property
    def busy(self) -> bool:
        """Whether stage 0 could start a step now (a later stage never starts one)."""
        if self.loop is None:
            return False
        now = time.monotonic()
        if self.flights and (now - self.flights[0].sent_at > self.stale_after_s or self.routes.due(now)):
            return True  # a check is due: a later stage's replica may be gone
        if now < self._stuck_until:
            return False
        scheduler = self.loop.scheduler
        return (
            scheduler.has_work
            and scheduler.in_flight < scheduler.config.max_in_flight
            and (scheduler.idle_sequences > 0)
        )

    def run(self, msg: StepMessage) -> Steps[None]:
        """Stage 0: admit a batch's jobs (a prefill), or take a step's sampled tokens back; a later
        stage: run a step over its layers."""
        self._stuck_until = 0.0
        if msg.kind == "step" and not self.partition.is_first:
            self._run_step(msg)
        elif msg.kind == "sampled" and self.loop is not None:
            self._sampled(Sampled.from_wire(msg.plan))
        elif msg.kind == "prefill" and self.loop is not None:
            try:
                self._admit(msg)
            except Exception as exc:  # the worker's error boundary: this batch fails, the loop goes on
                log.exception("batch %s could not be admitted", msg.batch_id)
                self._fail(msg, exc)
            self.received.append(msg.batch_id)
        else:
            log.warning(
                "batch %s: a %s message for stage %d on the step engine, ignored",
                msg.batch_id,
                msg.kind,
                self.identity.stage,
            )
        if self.loop is not None:
            self.advertise_credit()
            self.wake.set()
        yield from ()

    def advertise_credit(self) -> None:
        """Tell the batcher what this replica may still take, if that changed since it last did."""
        if self.advertise is None or self.loop is None:
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
        flown = {r.seq_id for flight in self.flights for r in flight.plan.rows}
        if flown.intersection(job_ids):  # the recovery monitor took a job of a plan still in flight for lost
            log.warning(
                "a job of a plan in flight was recovered: the plans in flight of %s are lost", msg.model
            )
            self._reset(shun=True)
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
                self.head.add(Seq(job_id, ids, tokens, rank=rank, reuse=not asks))
            except Exception as exc:  # too long for the KV cache, or not servable here: alone
                self._fail_row(job_id, exc)
                continue
            if asks and self.head.whole:  # else the last stage keeps them
                self.echoes[job_id] = (ids, {})
            self.rows[job_id] = seq
            self.batch_of[job_id] = msg.batch_id
            if not self.head.whole:
                self._unseen[job_id] = msg.batch_id
            waiting.add(job_id)
        if waiting:
            self.waits[msg.batch_id] = waiting
        else:
            self.outcomes.batch_done(msg.model, msg.batch_id)

    def pump(self) -> Steps[None]:
        """Run steps while one can start; admissions and sampled tokens (urgent) run between two."""
        while self.busy:
            self.step_once()
            yield

    def step_once(self) -> None:
        """Plan and run one step: on a whole pipeline, sample and publish it too; else send it to
        stage 1. A step that raises fails the jobs this replica holds."""
        try:
            self._check_flights()
            self._plan_and_run()
        except Exception as exc:  # the worker's error boundary: the loop's jobs fail, the worker goes on
            log.exception("an engine step of %s failed", self.identity.model)
            self._step_failed(f"the engine step failed: {type(exc).__name__}: {exc}")
        self.advertise_credit()

    def _step_failed(self, message: str) -> None:
        """Fail every job this replica holds (a step failed), and start again with none."""
        held = list(self.rows)
        when = {j: {"batch_id": self.rows[j].batch_id, "status": JobStatus.RUNNING} for j in held}
        try:
            failed = self.outcomes.fail(held, code="worker_error", message=message, when=when)
            metrics.job_ended(self.identity.model, "failed", "worker_error", failed)
        except Exception:  # Redis away too: the jobs stay running, and the recovery monitor takes them
            log.exception("the jobs of the failed step could not be failed; they will be recovered")
        self._reset()

    def _reset(self, *, shun: bool = False) -> None:
        """Let go of every job and plan (their records untouched: failed already, or the recovery
        monitor's); answers to plans made before are ignored from now on. With `shun`, the replicas
        sent to lost the plans: none of them is picked again while its heartbeat may still look live."""
        for job_id in list(self.rows):
            self._leave(job_id)
        self.head.reset()  # the failed step's plan was never applied
        self.flights.clear()
        self.routes.drop(shun=shun)
        self._unseen.clear()
        self._epoch += 1

    def _plan_and_run(self) -> None:
        loop = self.head
        if not loop.whole and not self._route():
            self._stuck_until = time.monotonic() + CHECK_S  # no replica of a later stage yet
            return
        depth = loop.scheduler.config.max_in_flight
        if loop.scheduler.in_flight >= depth:
            return  # a plan in flight on every stage (this was a check of them)
        held = len(loop.scheduler.sequences)
        plan = loop.scheduler.schedule(max_seqs=-(-held // depth) if depth > 1 else None)
        if not plan.rows:  # everything in flight, or nothing fits: wait for sampled tokens (a while)
            self._stuck_until = time.monotonic() + (0.0 if plan.preempted else STUCK_S)
            return
        group = min(set(range(depth)) - {f.group for f in self.flights})
        started = time.perf_counter()
        if loop.whole:
            final: list[torch.Tensor] | None = [] if self.echoes else None
            logits = loop.run(plan, final)
            self._observe_latency(time.perf_counter() - started)
            self._count_prompts(plan)
            tokens, left = self._sample_step(plan, logits, final[0] if final else None)
            self._apply(plan, tokens, left)
            return
        step, ids, sample = layout(plan, self.partition.device)
        hidden = loop.run_stage(0, step, ids, sample, group=group)
        self._observe_latency(time.perf_counter() - started)
        self._count_prompts(plan)
        unseen = {r.seq_id: self._unseen.pop(r.seq_id) for r in plan.rows if r.seq_id in self._unseen}
        wire = PlanWire(
            plan,
            self.identity.worker,
            group,
            self._epoch,
            loop.scheduler.config.num_blocks,
            unseen,
            tuple(self._gone),
        )
        self._gone.clear()
        self.flights.append(Flight(plan, group, time.monotonic()))
        self._send_on(
            StepMessage(
                batch_id=f"{self.identity.worker}:{self._epoch}:{plan.step}",
                model=self.identity.model,
                stage=0,
                num_stages=self.identity.num_stages,
                kind="step",
                step=plan.step,
                seq_ids=[r.seq_id for r in plan.rows],
                routes=[self.identity.lane, *self.routes.lanes],
                plan=wire.to_wire(),
            ),
            hidden,
        )

    def _apply(self, plan: StepPlan, tokens: dict[str, int], left: Iterable[str]) -> None:
        """Stage 0 takes a step's sampled tokens: its scheduler appends them, and the jobs that left
        (finished, cancelled, failed alone) leave it."""
        self.head.scheduler.update(plan, tokens)
        for job_id in tokens:
            self._first_token(job_id)
        for job_id in left:
            self._leave(job_id, tell=False)
        self._keep_waiting_alive()

    def _sampled(self, sampled: Sampled) -> None:
        """Stage 0: the last stage's answer to the oldest plan in flight."""
        if sampled.epoch != self._epoch or not self.flights or self.flights[0].plan.step != sampled.step:
            log.info(
                "step %d of epoch %d came back after its plans were dropped", sampled.step, sampled.epoch
            )
            return
        flight = self.flights.popleft()
        if sampled.error is not None:
            self._step_failed(sampled.error)
            return
        try:
            self._apply(flight.plan, sampled.tokens, sampled.left)
        except Exception as exc:  # the worker's error boundary, as a step's
            log.exception("the sampled tokens of step %d could not be applied", sampled.step)
            self._step_failed(f"the engine step failed: {type(exc).__name__}: {exc}")

    def _route(self) -> bool:
        """Stage 0 of several: whether the replicas of the later stages it sends to are picked and
        live. One gone drops every plan in flight and the jobs with them, to the recovery monitor
        (their caches are gone), and others are picked."""
        checked = self.routes.check()
        if checked is None:
            return True
        if checked is False:
            log.error(
                "a later stage's replica of %s stopped; its %d jobs go to the recovery monitor",
                self.identity.model,
                len(self.rows),
            )
            self._reset(shun=True)
        if not self.routes.pick():
            log.warning("stage 0 of %s waits for a replica of every later stage", self.identity.model)
            return False
        return True

    def _check_flights(self) -> None:
        """A plan in flight longer than `stale_after_s`: a later stage lost it. Every plan and job
        is let go, to the recovery monitor."""
        if self.flights and time.monotonic() - self.flights[0].sent_at > self.stale_after_s:
            log.error(
                "step %d of %s was not answered in %.0f s; its %d jobs go to the recovery monitor",
                self.flights[0].plan.step,
                self.identity.model,
                self.stale_after_s,
                len(self.rows),
            )
            self._reset(shun=True)

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
        pool, cache = self.head.scheduler.pool, self.head.caches[0]
        metrics.PREFIX_CACHE_BYTES.labels(*labels).set(pool.cached_blocks * cache.nbytes() // pool.num_blocks)

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

    def _leave(self, job_id: str, *, tell: bool = True) -> None:
        """Stage 0 lets go of a job; with `tell`, the last stage of several is told with the next step."""
        self.head.abort(job_id)
        if tell and not self.head.whole and job_id in self.rows:
            self._gone.append(job_id)
        self.rows.pop(job_id, None)
        self.echoes.pop(job_id, None)
        self._unseen.pop(job_id, None)
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
