"""The step engine's stages after stage 0, and what every stage of it shares: running a plan's step
over the stage's layers and paged cache, and (the last stage) sampling and publishing its tokens.

Stage 0 (`app.workers.engine.runtime.EngineRuntime`) plans each step and runs it over its own
layers; in a pipeline of several workers it sends the plan and its hidden states to stage 1's
replica on its lane (`app.workers.engine.wire`), each stage sends them on to the next, and the last
stage samples, publishes the tokens (stop strings, grammars, logprobs, failing a job alone: the
stage runtime's own code) and sends them back to stage 0, whose scheduler takes them. A later stage
keeps a paged cache for each stage 0 it serves, made on its first step with that stage's geometry;
the last stage reads a job's request the first time a plan names it (`new`), and forgets it when it
leaves or stage 0 says it let go of it (`gone`). Both are let go once their stage 0's heartbeat has
stopped, never while it beats (its scheduler may still name blocks cached here). A step that fails
on a later stage is reported to stage 0, which fails its jobs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from app.core import metrics
from app.core.jobs import text_of
from app.core.protocol import StepMessage
from app.partitions import ragged
from app.partitions.codecs import decode_tensor
from app.partitions.paged import LayerAttention, PagedCache
from app.workers import echo
from app.workers.decode import Sequence, advance
from app.workers.engine.loop import layout
from app.workers.engine.scheduler import StepPlan
from app.workers.engine.wire import PlanWire, Sampled
from app.workers.stage import StageRuntime

log = logging.getLogger(__name__)

# A prompt, and the final hidden states of its chunks run so far, by first position.
Echo = tuple[tuple[int, ...], dict[int, torch.Tensor]]


@dataclass
class Upstream:
    """A later stage's cache for one pipeline replica's stage 0 (named by its lane)."""

    head: str  # stage 0's worker
    cache: PagedCache
    num_blocks: int
    rules: dict[int, LayerAttention]


@dataclass
class EngineStage(StageRuntime):
    """What every stage of a step-engine pipeline does with a plan's step (the module's docstring)."""

    rows: dict[str, Sequence] = field(init=False, default_factory=dict)  # running jobs' sampling state
    # job -> its prompt and the final hidden states of the prompt's chunks run so far, by first
    # position (echo's prompt logprobs), until its first token
    echoes: dict[str, Echo] = field(init=False, default_factory=dict)
    heartbeat_ttl_s: float = 30.0  # a worker without a heartbeat for this long is gone
    # a later stage: a cache for each stage 0 it serves, and the stage 0 of each sampling state
    upstreams: dict[str, Upstream] = field(init=False, default_factory=dict)
    _head_of: dict[str, str] = field(init=False, default_factory=dict)
    _swept_at: float = field(init=False, default=0.0)

    def _send_on(self, msg: StepMessage, hidden: torch.Tensor) -> None:
        """Hand a step's hidden states [T, D] to the next stage's replica of its route."""
        tensors = {"hidden": self.codec.encode(hidden)}
        if self.claims is not None:
            tensors = self.claims.put_all(tensors)
        nxt = msg.forward(stage=msg.stage + 1, tensors=tensors)
        self.hand_off(nxt, nxt.routes[nxt.stage] or "")

    def _observe_latency(self, took: float) -> None:
        metrics.PARTITION_LATENCY.labels(self.identity.model, str(self.identity.stage)).observe(took)
        if self.latency is not None:
            self.latency.observe(took)

    def _run_step(self, msg: StepMessage) -> None:
        """Run a step over this stage's layers; send it on, or (the last stage) sample it and send
        the tokens back to stage 0. A step that fails is reported to stage 0, which fails its jobs."""
        wire = PlanWire.from_wire(msg.plan)
        self._sweep()
        try:
            if self.claims is not None:
                msg = msg.forward(tensors=self.claims.get_all(msg.tensors))
            upstream = self._upstream(msg.routes[0] or "", wire)
            last = self.partition.is_last
            if last:
                self._forget(wire.gone)
                self._learn(wire.new, wire.head)
            x = decode_tensor(msg.tensors["hidden"]).to(self.partition.hidden_dtype)
            step, _, sample = layout(wire.plan, self.partition.device)
            final: list[torch.Tensor] | None = [] if last and self.echoes else None
            started = time.perf_counter()
            out = ragged.forward(
                self.partition,
                upstream.cache,
                step,
                x,
                rules=upstream.rules,
                sample=sample,
                final=final,
                group=wire.group,
            )
            self._observe_latency(time.perf_counter() - started)
            if not last:
                self._send_on(msg, out)
                return
            tokens, left = self._sample_step(wire.plan, out, final[0] if final else None)
            outcome = Sampled(wire.plan.step, wire.epoch, tokens, tuple(left))
        except Exception as exc:  # the worker's error boundary: stage 0 fails the step's jobs
            log.exception("step %d of %s failed on stage %d", msg.step, msg.model, self.identity.stage)
            outcome = Sampled(
                wire.plan.step,
                wire.epoch,
                error=f"stage {self.identity.stage} failed: {type(exc).__name__}: {exc}",
            )
        self.hand_off(
            msg.forward(stage=0, kind="sampled", tensors={}, plan=outcome.to_wire()), msg.routes[0] or ""
        )

    def _upstream(self, lane: str, wire: PlanWire) -> Upstream:
        """The cache kept for the stage 0 at `lane`, made on its first step."""
        upstream = self.upstreams.get(lane)
        if upstream is None or upstream.num_blocks != wire.num_blocks:
            cache = ragged.cache_for(self.partition, wire.num_blocks, wire.plan.block_size)
            rules = ragged.layer_rules(self.partition)
            upstream = self.upstreams[lane] = Upstream(wire.head, cache, wire.num_blocks, rules)
        return upstream

    def _learn(self, new: dict[str, str], head: str) -> None:
        """The last stage reads the requests of sequences it has not seen (anew, if it held one by
        that name: a job recovered onto the same pipeline)."""
        if not new:
            return
        job_ids = list(new)
        for job_id in job_ids:
            self._forget([job_id])
        records = self.jobs.get_many(job_ids)
        for job_id, record in zip(job_ids, records, strict=True):
            try:
                seq = self._sequence(new[job_id], job_id, record)
                if echo.asked({job_id: seq}):
                    self.echoes[job_id] = (tuple(self._input_ids(job_id, record)), {})
            except Exception as exc:  # alone: its sampling row will say it left
                self._fail_row(job_id, exc)
                continue
            self.rows[job_id] = seq
            self._head_of[job_id] = head

    def _forget(self, job_ids: Iterable[str]) -> None:
        for job_id in job_ids:
            self.rows.pop(job_id, None)
            self.echoes.pop(job_id, None)
            self._head_of.pop(job_id, None)

    def _sweep(self) -> None:
        """Now and then (every heartbeat lifetime): the caches and sampling states kept for a stage 0
        whose heartbeat stopped are let go. (Never for one that is live, however long idle: its
        scheduler may still name the blocks its prompts left cached here.)"""
        now = time.monotonic()
        if not self.upstreams or now - self._swept_at < self.heartbeat_ttl_s:
            return
        self._swept_at = now
        since = time.time() - self.heartbeat_ttl_s
        beating = self.redis.zrangebyscore(self.keys.workers(self.identity.model, 0), since, "+inf")
        live = set(map(text_of, beating))
        self._forget([j for j, head in self._head_of.items() if head not in live])
        for lane in [k for k, u in self.upstreams.items() if u.head not in live]:
            del self.upstreams[lane]

    # ------------------------------------------------------------------ the last stage

    def _sample_step(
        self, plan: StepPlan, logits: torch.Tensor, hidden: torch.Tensor | None
    ) -> tuple[dict[str, int], list[str]]:
        """Sample a step's logits [R, V] and publish the tokens: a token for every sampling row
        (0 for a job that failed alone), and the jobs that left."""
        if hidden is not None:
            self._keep_prompt_columns(plan, hidden)
        sampling = [r.seq_id for r in plan.rows if r.samples]
        index = [i for i, j in enumerate(sampling) if j in self.rows]
        candidates = [self.rows[sampling[i]] for i in index]
        kept = self._choose(candidates, logits[index]) if index else []
        tokens = dict.fromkeys(sampling, 0) | {seq.job_id: token for seq, token, _ in kept}
        asking = {seq.job_id for seq, _, _ in kept if seq.job_id in self.echoes}
        echoes = self._prompt_logprobs(sorted(asking))
        kept = [k for k in kept if k[0].job_id in echoes or k[0].job_id not in asking]
        chosen = {seq.job_id for seq, _, _ in kept}
        left = [j for j in sampling if j not in chosen]  # its sampling or its echo failed: failed alone
        outs = echo.attach([advance(seq, token, self.eos_ids, lp) for seq, token, lp in kept], echoes)
        gone = self.outcomes.tokens(outs) if outs else set()
        self._observe([seq for seq, _, _ in kept], outs, gone)
        left += [seq.job_id for seq, _, _ in kept if seq.job_id in gone or seq.finish_reason is not None]
        self._forget(left)
        return tokens, left

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
