"""One stage of a model pipeline: run a step over this stage's layers and pass the result on.

`StageRuntime.run` runs every stage message, handed over by the Celery task (prefill, from the
stage's shared queue) or by the lane consumer (everything after, see `app.workers.lane`) to the
worker's compute thread, which drives it layer by layer (`app.workers.compute`). It does
not know about either: messages go out through the injected `send(message, queue)` (Celery, any
replica of the next stage) and `hand_off(message, lane)` (the replica holding the batch). The
last stage samples, publishes tokens and sends the next decode step back to stage 0 until the
batch is done.

It is the I/O around pure state: the batches it holds are `app.workers.batches.Batches` (one
record per batch), and the last stage's per-token rules are `app.workers.decode`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from app.core import metrics
from app.core.errors import ConveyorError, InvalidRequest
from app.core.grammar import Grammar
from app.core.jobrecord import JobRecord
from app.core.jobs import JobStatus, Transition
from app.core.jobstore import JobStore
from app.core.keys import BATCH_LOG_MAXLEN, Keys
from app.core.outcomes import Outcomes, TokenOut
from app.core.protocol import StepMessage
from app.core.steps import Steps, complete
from app.partitions.claimcheck import ClaimCheck
from app.partitions.codecs import CodecSpec, decode_tensor, encode_tensor
from app.partitions.layers import BatchState, StagePartition, left_pad
from app.partitions.prefix import Prefill, PrefixCache
from app.workers import echo
from app.workers.batches import Batches, BatchGone, Join
from app.workers.decode import Sequence, advance, held_tokens, settle
from app.workers.grammar import GrammarError, Grammars, Matcher
from app.workers.latency import StepLatency
from app.workers.sampling import Logprobs, ban_tokens, constrain, make_generator, sample, token_logprobs
from app.workers.textstream import TextStream

log = logging.getLogger(__name__)

Send = Callable[[StepMessage, str], None]


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
    outcomes: Outcomes
    redis: Any
    keys: Keys
    send: Send  # Celery: a shared stage queue
    hand_off: Send  # the lane of the replica that holds the batch
    latency: StepLatency | None = None
    codec: CodecSpec = field(default_factory=CodecSpec)  # how hidden states travel to the next stage
    claims: ClaimCheck | None = None  # large tensors go by reference through Redis
    eos_ids: frozenset[int] = frozenset()
    pad_id: int = 0
    max_running: int = 64  # sequences in one running batch, joiners included
    # A join pads every row to the longest: rows x positions of the merged batch stays under this,
    # so one long-context job cannot make a running batch's KV cache explode.
    max_kv_positions: int = 65536
    batches: Batches = field(default_factory=Batches)
    # A batch not stepped for this long lost a stage (its jobs were recovered elsewhere): forget it.
    stale_after_s: float = 120.0
    # Prompt prefixes this stage computed, reused by later prompts that start with them; None: off.
    prefixes: PrefixCache | None = None
    # Last stage: the compiled output grammars of structured outputs (made on the first job with one).
    grammars: Grammars | None = None

    def handle(self, msg: StepMessage) -> None:
        """Run one stage message to its end."""
        complete(self.run(msg))

    def run(self, msg: StepMessage) -> Steps[None]:
        """Run one stage message, suspended between two layers of its step. One bad batch fails
        its jobs; the worker keeps serving."""
        now = time.monotonic()
        for batch_id, idle in self.batches.stale(now, self.stale_after_s):
            if batch_id in self.batches:  # not discarded already, as a joiner of another
                log.warning("batch %s: no step for %.0f s, dropping its state", batch_id, idle)
                self._discard(batch_id)
        if msg.kind != "release":
            self.batches.touch(msg.batch_id, now)
        if msg.kind == "release":
            for batch_id in (msg.batch_id, *msg.merge):
                self._free(batch_id)
            return
        try:
            yield from self._step(msg)
        except BatchGone as gone:
            log.warning("batch %s step %d on stage %d: %s", msg.batch_id, msg.step, self.identity.stage, gone)
            self._discard_batch(msg)
        except Exception as exc:  # the worker's error boundary
            log.exception("batch %s step %d failed on stage %d", msg.batch_id, msg.step, self.identity.stage)
            self._fail(msg, exc)

    def _step(self, msg: StepMessage) -> Steps[None]:
        if self.claims is not None:
            msg = msg.forward(tensors=self.claims.get_all(msg.tensors))
        prefill: Prefill | None = None
        if msg.kind == "prefill":
            msg, prefill, x, records = self._begin(msg)  # records: stage 0's, read for the prompts
            if not msg.seq_ids:
                self._end_batch(msg)
                return
            last = self.partition.is_last
            sequences = self._load_sequences(msg.batch_id, msg.seq_ids, records) if last else None
            keep = echo.asked(sequences or {})  # then every prompt column is computed here, and read
            state, x = prefill.start(x, whole=keep)
            state.keep_hidden, routes = keep, msg.routes if sequences is not None else None
            now = time.monotonic()
            self.batches.begin(msg.batch_id, state, now, routes=routes, sequences=sequences).prefilling = True
        else:
            state = self.batches.resume(msg.batch_id, msg.merge, msg.seq_ids)
            x = decode_tensor(msg.tensors["input_ids" if self.partition.is_first else "hidden"])
        try:
            out, took = yield from self._run_layers(state, x)
            metrics.PARTITION_LATENCY.labels(self.identity.model, str(self.identity.stage)).observe(took)
            if self.latency is not None:
                self.latency.observe(took)
            if prefill is not None:
                out = self._prefilled(prefill, state, out)
            if self.partition.is_last:
                rows = self.batches[msg.batch_id].sequences
                self._sample(msg, out, echo.take(self.partition, state, prefill, rows))
            else:
                self._forward(msg, prefill, out)
        finally:
            running = self.batches.get(msg.batch_id)
            if running is not None:
                running.prefilling = False

    def _run_layers(self, state: BatchState, x: torch.Tensor) -> Steps[tuple[torch.Tensor, float]]:
        """This stage's layers over one step, and the seconds they computed (not the time the step
        was suspended for other batches' work)."""
        steps, busy = self.partition.steps(state, x), 0.0
        while True:
            started = time.perf_counter()
            try:
                next(steps)
            except StopIteration as done:
                return done.value, busy + time.perf_counter() - started
            busy += time.perf_counter() - started
            yield  # between two layers: the compute thread may run urgent work for other batches

    def _begin(
        self, msg: StepMessage
    ) -> tuple[StepMessage, Prefill, torch.Tensor, list[JobRecord | None] | None]:
        """Prefill: the batch's rows as this stage receives them (its whole prompts: token ids on
        stage 0, hidden states on the others), and what its prefix cache has of them."""
        routes = list(msg.routes) or [None] * msg.num_stages
        routes[self.identity.stage] = self.identity.lane
        if self.partition.is_first:
            # A job cancelled meanwhile, or rescheduled into another batch (a late redelivery), drops out.
            moves = [Transition(j, JobStatus.RUNNING, when={"batch_id": msg.batch_id}) for j in msg.seq_ids]
            started = set(self.jobs.apply(moves, strict=False))
            seq_ids = [j for j in msg.seq_ids if j in started]
            msg = msg.forward(seq_ids=seq_ids, routes=routes)
            if not seq_ids:
                return msg, Prefill(None, self.partition, [], None, torch.zeros(0, 0)), torch.zeros(0), None
            self.jobs.progressed(seq_ids, time.time())
            records = self.jobs.get_many(seq_ids)
            prompts = [self._input_ids(j, r) for j, r in zip(seq_ids, records, strict=True)]
            x, mask = left_pad(prompts, self.pad_id)
        else:
            msg, records = msg.forward(routes=routes), None
            x = decode_tensor(msg.tensors["hidden"]).to(self.partition.hidden_dtype)
            mask = decode_tensor(msg.tensors["attention_mask"]).long()
            ids = decode_tensor(msg.tensors["input_ids"])  # the prompts' ids come with the hidden states
            prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)]
        return msg, Prefill(self.prefixes, self.partition, msg.seq_ids, prompts, mask), x, records

    def _prefilled(self, prefill: Prefill, state: BatchState, out: torch.Tensor) -> torch.Tensor:
        """The prefill's output over whole prompts; its new prefixes stored, its reuse counted."""
        out = prefill.finish(state, out)
        if prefill.cache is not None:
            labels = (self.identity.model, str(self.identity.stage))
            metrics.PREFIX_TOKENS.labels(*labels, "cache").inc(prefill.reused)
            metrics.PREFIX_TOKENS.labels(*labels, "computed").inc(prefill.computed)
            metrics.PREFIX_CACHE_BYTES.labels(*labels).set(prefill.cache.nbytes)
        return out

    def _input_ids(self, job_id: str, record: JobRecord | None) -> list[int]:
        """The prompt; for a recovered job, the prompt and the tokens it had already streamed."""
        if record is None or record.prompt_ids is None:
            raise ValueError(f"job {job_id} has no prompt (its record expired, or it ended)")
        ids = list(record.prompt_ids)
        if record.attempts:
            ids += self.outcomes.emitted(job_id)
        return ids

    def _load_sequences(
        self, batch_id: str, job_ids: list[str], records: list[JobRecord | None] | None = None
    ) -> dict[str, Sequence]:
        """The batch's sequences, from their records (read here unless given). A job whose request
        cannot be run (sampling values out of bounds, a broken record) fails alone: `_sample` skips it."""
        sequences = {}
        records = self.jobs.get_many(job_ids) if records is None else records
        for job_id, record in zip(job_ids, records, strict=True):
            try:
                sequences[job_id] = self._sequence(batch_id, job_id, record)
            except Exception as exc:  # this job's error boundary: the rest of the batch goes on
                self._fail_row(job_id, exc)
        return sequences

    def _sequence(self, batch_id: str, job_id: str, record: JobRecord | None) -> Sequence:
        if record is None or record.request is None:
            raise InvalidRequest(f"job {job_id} has no request (expired, or not a generation job)")
        request = record.request
        params = request.sampling
        problem = params.problem()
        if problem is not None:
            raise InvalidRequest(problem)
        seq = Sequence(
            job_id=job_id,
            batch_id=batch_id,
            params=params,
            generator=make_generator(params),
            max_tokens=request.max_tokens,
            text=TextStream(
                self.tokenizer, list(request.stop), skip_special_tokens=request.skip_special_tokens
            ),
            ignore_eos=request.ignore_eos,
            min_tokens=request.min_tokens,
            created_at=record.created_at,
            priority=record.priority,
            grammar=self._grammar(request.grammar),
            prompt_ids=(record.prompt_ids or ()) if params.repetition_penalty != 1.0 else (),
        )
        if record.attempts:  # recovered: carry on from what was streamed
            for token in self.outcomes.emitted(job_id):
                seq.text.push(token)
                seq.generated += 1
                if seq.grammar is not None:  # its matcher replays the tokens it had
                    seq.grammar.consume(token)
        return seq

    def _forward(self, msg: StepMessage, prefill: Prefill | None, hidden: torch.Tensor) -> None:
        tensors = {"hidden": self.codec.encode(hidden)}  # [B, S, D]
        if prefill is not None:
            tensors["attention_mask"] = encode_tensor(prefill.mask.to(torch.int8))
            if prefill.prompts:
                ids, _ = left_pad(prefill.prompts, self.pad_id)
                tensors["input_ids"] = encode_tensor(ids.to(torch.int32))
        if self.claims is not None:
            tensors = self.claims.put_all(tensors)
        nxt = msg.forward(stage=msg.stage + 1, tensors=tensors)
        lane = nxt.routes[nxt.stage] if nxt.kind == "decode" else None
        if lane:
            self.hand_off(nxt, lane)
        else:
            self.send(nxt, self.identity.next_queue or "")

    def _sample(self, msg: StepMessage, logits: torch.Tensor, echoes: dict[str, echo.Entries]) -> None:
        sequences = self.batches[msg.batch_id].sequences
        # A job that failed alone (`_fail_row`) is no longer in `sequences`: its row is skipped.
        index = [i for i, j in enumerate(msg.seq_ids) if j in sequences]
        candidates = [sequences[msg.seq_ids[i]] for i in index]
        kept = self._choose(candidates, logits[index])
        chosen = {seq.job_id for seq, _, _ in kept}
        for seq in candidates:
            if seq.job_id not in chosen:
                del sequences[seq.job_id]
        rows = [seq for seq, _, _ in kept]
        tokens = [token for _, token, _ in kept]
        outs = echo.attach([advance(seq, token, self.eos_ids, lp) for seq, token, lp in kept], echoes)
        gone = self.outcomes.tokens(outs)  # cancelled, or recovered elsewhere: these rows leave now
        self._observe(rows, outs, gone)
        alive = settle(sequences, rows, tokens, gone)
        if msg.kind == "prefill" and alive and self._join_running(msg, alive):
            return
        if msg.kind == "prefill":
            # Prefilled: the batch no longer takes one of the pipeline's prefill slots; its
            # sequences count against the pipeline's sequence budget (the progress set) instead.
            self.outcomes.batch_done(msg.model, msg.batch_id)
        self._continue(msg, alive)

    def _choose(
        self, candidates: list[Sequence], logits: torch.Tensor
    ) -> list[tuple[Sequence, int, Logprobs | None]]:
        """Each row's next token from its logits [B, V] under its request's rules (min_tokens,
        penalties, biases, its grammar, its seed), with the logprobs it asked for. A row whose
        sampling or grammar fails is failed alone (`_fail_row`) and left out."""
        logits = logits.float().cpu()  # sampling runs on the CPU, per-sequence generators
        raw = logits  # what the model gave: the logprobs a job asks for are of these
        held = held_tokens(candidates, self.eos_ids)
        for seq in candidates:
            seq.reseed()
        logits = ban_tokens(logits, held)  # min_tokens: no end of sequence yet
        logits = constrain(  # penalties, logit_bias, allowed and banned tokens
            logits,
            [s.params for s in candidates],
            prompts=[s.prompt_ids for s in candidates],
            outputs=[s.text.ids for s in candidates],
        )
        logits, stuck = self._mask_grammars(logits, candidates)  # structured outputs
        sampled = self._follow_grammars(self._sample_rows(logits, candidates), stuck)
        logprobs = token_logprobs(raw, [t or 0 for _, t in sampled], [s.params.logprobs for s in candidates])
        return [
            (seq, token, lp) for (seq, token), lp in zip(sampled, logprobs, strict=True) if token is not None
        ]

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

    def _mask_grammars(self, logits: torch.Tensor, rows: list[Sequence]) -> tuple[torch.Tensor, set[int]]:
        """The rows' logits with what each row's grammar forbids masked; the rows that can go on in
        no token of their grammar. logits: [B, V]."""
        if self.grammars is None or all(s.grammar is None for s in rows):
            return logits, set()
        logits, stuck = self.grammars.constrain(logits, [s.grammar for s in rows])
        return logits, set(stuck)

    def _follow_grammars(
        self, sampled: list[tuple[Sequence, int | None]], stuck: set[int]
    ) -> list[tuple[Sequence, int | None]]:
        """Each constrained row's matcher advanced by its token; a row its grammar cannot continue
        fails alone (None)."""
        followed: list[tuple[Sequence, int | None]] = []
        for i, (seq, token) in enumerate(sampled):
            if seq.grammar is not None and token is not None:
                try:
                    if i in stuck:
                        raise GrammarError("no token can continue the output under its grammar")
                    seq.grammar.consume(token)
                except GrammarError as exc:
                    self._fail_row(seq.job_id, exc)
                    token = None
            followed.append((seq, token))
        return followed

    def _grammar(self, grammar: Grammar | None) -> Matcher | None:
        """A new sequence's matcher for the grammar its request names (None: unconstrained)."""
        if grammar is None:
            return None
        if self.grammars is None:
            vocab = int(self.partition.config.vocab_size)
            self.grammars = Grammars(self.tokenizer, eos_ids=self.eos_ids, vocab_size=vocab)
        return self.grammars.matcher(grammar)

    def _fail_row(self, job_id: str, exc: Exception) -> None:
        """Fail one job of a batch; the batch goes on without it (its row leaves at the next step)."""
        log.warning(
            "job %s failed alone on stage %d: %s: %s", job_id, self.identity.stage, type(exc).__name__, exc
        )
        code = exc.code if isinstance(exc, ConveyorError) else "worker_error"
        message = exc.message if isinstance(exc, ConveyorError) else f"{type(exc).__name__}: {exc}"
        failed = self.outcomes.fail(
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
        host = self.batches.host_for(
            msg.batch_id,
            msg.routes,
            msg.num_stages,
            len(alive),
            max_running=self.max_running,
            max_kv_positions=self.max_kv_positions,
        )
        if host is None:
            return False
        self.batches.park(host, Join(msg, alive))
        self.outcomes.batch_done(msg.model, msg.batch_id)  # it no longer takes a prefill slot
        self.redis.xadd(
            self.keys.batch_log(),
            {"batch_id": msg.batch_id, "model": msg.model, "size": len(alive), "joined": host},
            maxlen=BATCH_LOG_MAXLEN,
            approximate=True,
        )
        return True

    def _continue(self, msg: StepMessage, alive: list[tuple[str, int]]) -> None:
        """Send the next decode step of this batch, with any batches that join it now."""
        joins = self.batches.take_joins(msg.batch_id)
        for join in joins:
            alive = alive + join.alive
        if not alive:
            self._end_batch(msg)
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

    def _end_batch(self, msg: StepMessage) -> None:
        """The batch is over (finished, or failed): its state freed on every stage, the batches
        waiting to join it go on alone, the batcher told."""
        self._release_elsewhere(msg)
        for batch_id in (msg.batch_id, *msg.merge):
            self._free(batch_id)
        self.outcomes.batch_done(msg.model, msg.batch_id)

    def _fail(self, msg: StepMessage, exc: Exception) -> None:
        """Fail the jobs this batch still holds. A job recovered meanwhile (re-queued, or scheduled
        into another batch) has left it: its record names another batch, or no longer a running
        one, and it is not failed here."""
        running = self.batches.get(msg.batch_id)
        state = running.state if running is not None else None
        owned = {msg.batch_id, *msg.merge} | (state.batch_ids if state is not None else set())
        job_ids = list(dict.fromkeys([*msg.seq_ids, *(state.seq_ids if state is not None else [])]))
        mine = self.jobs.held_in(job_ids, owned)
        failed = self.outcomes.fail(
            list(mine),
            code="worker_error",
            message=f"stage {self.identity.stage} failed: {type(exc).__name__}: {exc}",
            when=mine,
        )
        metrics.job_ended(self.identity.model, "failed", "worker_error", failed)
        self._end_batch(msg)

    def _discard_batch(self, msg: StepMessage) -> None:
        """A batch this stage cannot step: its state and its joiners' discarded on every stage, its slot
        given back; its jobs, no longer progressing, are recovered by the monitor, not failed."""
        for batch_id in (msg.batch_id, *msg.merge):
            self._discard(batch_id)
        self._release_elsewhere(msg)
        self.outcomes.batch_done(msg.model, msg.batch_id)

    def _release_elsewhere(self, msg: StepMessage) -> None:  # every other stage of its route frees it
        for stage, lane in enumerate(msg.routes):
            if lane and stage != self.identity.stage:
                self.hand_off(msg.forward(stage=stage, kind="release", seq_ids=[], tensors={}), lane)

    def _discard(self, batch_id: str) -> None:
        """Free a batch's state here, and that of the batches waiting to join it."""
        for join in self.batches.drop(batch_id):
            self._discard(join.msg.batch_id)

    def _free(self, batch_id: str) -> None:
        """Free a batch's state here; the batches waiting to join it go on alone."""
        for join in self.batches.drop(batch_id):
            self._continue(join.msg, join.alive)
