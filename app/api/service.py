"""What the routes do, without HTTP: submit a job, read it, follow its events, wait for its end."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import suppress
from dataclasses import dataclass, replace
from typing import Any

from fastapi.concurrency import run_in_threadpool

from app.api.catalog import Catalog, ModelInfo
from app.api.checks import (
    check_embeddings,
    check_entitled,
    check_messages,
    checked_request,
    digest,
    idempotency_digest,
)
from app.api.events import EventHub
from app.api.prompts import PromptEncoder
from app.api.schemas import JobCreate
from app.api.streams import Slot, StreamSlots
from app.batching.intake import intake_fields, padded_bytes, padded_positions
from app.core import metrics, routing
from app.core.admission import Admission
from app.core.config import EMBEDDING_MODEL, JobServiceSettings
from app.core.discovery import EMBEDDING
from app.core.errors import (
    ContextLengthExceeded,
    IdempotencyConflict,
    InvalidRequest,
    JobFailed,
    JobFinished,
    JobNotFound,
    SyncTimeout,
)
from app.core.follow import Event, follow, is_over
from app.core.jobrecord import JobRecord, JobRequest
from app.core.jobs import JobStatus
from app.core.keys import Keys
from app.core.ratelimit import Quota, RateLimiter
from app.core.sampling import SamplingParams
from app.core.scripts import RELEASE_IF_HELD, Script
from app.webhooks.intake import CallbackIntake

log = logging.getLogger(__name__)

POLL_FALLBACK_S = 1.0  # re-read the stream this often even if a pub/sub wake-up was missed
# A request answered at its job's end (POST /v1/inference and the OpenAI routes without `stream`,
# /v1/embeddings) waits this long for it, then is answered 504: ten minutes, longer than a job a
# client waits on runs. A generation job goes on, to be polled; an embeddings job is cancelled.
SYNC_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Submitted:
    record: JobRecord
    replayed: bool = False  # an Idempotency-Key named an existing job: this is it
    quota: Quota | None = None  # the tenant's rate limit after this submit (RateLimit-* headers)


class JobService:
    """One per API process (app.state.jobs). `settings`: `Settings.job_service`."""

    def __init__(self, settings: JobServiceSettings, redis: Any, catalog: Catalog, hub: EventHub) -> None:
        self.settings = settings
        self.sync_timeout_s = SYNC_TIMEOUT_S  # the wait of a request answered at its job's end
        self.redis = redis
        self.catalog = catalog
        self.hub = hub
        self.streams = StreamSlots(settings.tenant_max_streams)
        self.keys = Keys(settings.namespace)
        self.admission = Admission(redis, self.keys, settings.admission)
        self.store = self.admission.store  # the job record's writer (app/core/jobstore.py)
        self.ratelimit = RateLimiter(redis, self.keys, settings.rate_limiter)
        self.callbacks = CallbackIntake(settings.webhooks, redis, self.keys)  # Webhooks
        self._forget = Script(redis, RELEASE_IF_HELD)  # an Idempotency-Key, if it still names its job
        self._background: set[asyncio.Task[None]] = set()
        # Tokenizes on its own threads, never on the event loop.
        self.prompts = PromptEncoder()

    async def submit(
        self, request: JobCreate, *, tenant: str, idempotency_key: str | None = None
    ) -> Submitted:
        """Check what costs nothing, charge the tenant's rate limits (app/core/ratelimit.py) before any
        work (loading a tokenizer, tokenizing, resolving a callback's host), then admit
        (app/core/admission.py) and queue a job owned by `tenant`; with an Idempotency-Key (scoped
        to the tenant), the job that key already named (same body) instead of a new one."""
        check_entitled(self.settings, tenant, request.priority)
        idempotency = None
        if idempotency_key is not None:
            idempotency = (idempotency_digest(tenant, idempotency_key), digest(request.model_dump_json()))
            held = await self.redis.get(self.keys.idempotency(idempotency[0]))
            if held is not None:
                replayed = await self._replay(held, idempotency, tenant)
                if replayed is not None:
                    return replayed
        max_tokens, stop = checked_request(self.settings, request)
        quota = await self.ratelimit.take(tenant, tokens=max_tokens)
        try:
            written = await self._prepare_and_write(
                request, tenant=tenant, max_tokens=max_tokens, stop=stop, idempotency=idempotency
            )
        except Exception:
            await self._refund(tenant, max_tokens)  # not queued: its tokens will not be generated
            raise
        if isinstance(written, Submitted):  # another submit with the same key won the race
            await self._refund(tenant, max_tokens)
            return written
        assert written is not None  # a fresh job id: never one that exists
        if written.route:  # counted once queued: a refused job was served by no model
            metrics.ROUTES.labels(written.route, written.model, written.route_reason).inc()
        return Submitted(written, quota=quota)

    async def submit_line(self, request: JobCreate, *, tenant: str, job_id: str, deadline: float) -> bool:
        """A batch's line as a job (app/api/batchfeed.py): the submit path, gates and write included,
        without the tenant's rate limits (a batch is bounded by its file, and fed as the batch class
        has room), with the id the line's place gives it and the batch's window as its deadline.
        False when a job with that id exists already (the line was fed before): nothing is written."""
        check_entitled(self.settings, tenant, request.priority)
        max_tokens, stop = checked_request(self.settings, request)
        written = await self._prepare_and_write(
            request, tenant=tenant, max_tokens=max_tokens, stop=stop, idempotency=None, job=(job_id, deadline)
        )
        return written is not None

    async def _prepare_and_write(
        self,
        request: JobCreate,
        *,
        tenant: str,
        max_tokens: int,
        stop: list[str],
        idempotency: tuple[str, str] | None,
        job: tuple[str, float] | None = None,
    ) -> JobRecord | Submitted | None:
        """The work a charged submit pays for: its model (a route's choice), its prompt's tokens, its
        callback, the write. `job`: a batch line's job id and deadline (None: the job already exists)."""
        name = request.model or self.settings.default_model
        routed: dict[str, str] = {}  # the record's route fields: a route's name resolves to a model here
        route = self.catalog.route(name)
        if route is not None:
            name, reason = await self._route(route, request, max_tokens)
            routed = {"route": route.name, "route_reason": str(reason)}
        # Loading a tokenizer reads files: off the event loop, once; later requests find it cached.
        model = self.catalog.cached(name)
        if model is None:
            model = await run_in_threadpool(self.catalog.get, name)
        prompt_ids = await self.prompts.encode(model, request)
        bad_words = await self.prompts.encode_words(model, request.bad_words or [])
        sampling = request.sampling(model.sampling_defaults, bad_words)
        problem = sampling.problem(model.vocab_size)
        if problem is not None:
            raise InvalidRequest(problem)
        if len(prompt_ids) + max_tokens > model.context_length:
            raise ContextLengthExceeded(
                f"the prompt is {len(prompt_ids)} tokens and max_tokens is {max_tokens}, but the context of "
                f"{model.name} is {model.context_length} tokens",
                limit=model.context_length,
                prompt_tokens=len(prompt_ids),
            )
        callback = None  # Webhooks: the SSRF guard (DNS included) before anything is written
        if request.callback_url is not None:
            callback = await self.callbacks.check(
                request.callback_url, request.callback_events, tenant=tenant
            )
        return await self._admit_and_write(
            request,
            tenant=tenant,
            model_name=model.name,
            prompt_ids=prompt_ids,
            sampling=sampling,
            max_tokens=max_tokens,
            stop=stop,
            callback=callback,
            idempotency=idempotency,
            routed=routed,
            job=job,
        )

    async def model(self, name: str | None) -> ModelInfo:
        """A model by its exact name (the default when None), its tokenizer loaded off the event loop;
        404 model_not_found for any other name (a route's included)."""
        name = name or self.settings.default_model
        model = self.catalog.cached(name)
        return model if model is not None else await run_in_threadpool(self.catalog.get, name)

    async def _route(self, route: routing.Route, request: JobCreate, max_tokens: int) -> routing.Choice:
        """Resolve a route to one of its models at admission (app/core/routing.py): the request's
        features, and each model's pipeline as admission sees it (a chat also asks whether each
        model has a chat template, which loads its tokenizer once)."""
        chat = request.messages is not None
        text = "\n".join(m.content for m in request.messages) if request.messages else request.prompt or ""
        wanted = routing.features(text, max_tokens=max_tokens, chat=chat, timeout_s=request.timeout_s)
        now, state = time.time(), {}
        for name in (route.small, route.large):
            seen = await self.admission.outlook(name, request.priority, now)
            if chat:
                info = self.catalog.cached(name)
                if info is None:
                    info = await run_in_threadpool(self.catalog.get, name)
                seen = replace(seen, chat=info.chat)
            state[name] = seen
        return routing.choose(route, wanted, state)

    async def token_events(self, job_id: str) -> list[dict[str, Any]]:
        """The data of a job's token events, in order (its stream holds every one: its length is
        max_tokens_limit and a few), for what the job's record does not keep (logprobs)."""
        entries = await self.redis.xrange(self.keys.events(job_id), "-", "+")
        tokens = [json.loads(fields[b"data"]) for _, fields in entries if fields[b"event"] == b"token"]
        return sorted(tokens, key=lambda t: int(t["index"]))

    async def _refund(self, tenant: str, tokens: int) -> None:
        try:
            await self.ratelimit.refund(tenant, tokens=tokens)
        except Exception:  # the refusal being answered matters more than the refund
            log.warning("could not refund %d tokens to tenant %s", tokens, tenant, exc_info=True)

    async def _admit_and_write(
        self,
        request: JobCreate,
        *,
        tenant: str,
        model_name: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        max_tokens: int,
        stop: list[str],
        callback: Any,
        idempotency: tuple[str, str] | None,
        routed: dict[str, str],
        job: tuple[str, float] | None = None,
    ) -> JobRecord | Submitted | None:
        """The admission gates, then the job written with its intake entry: its record, or the job an
        Idempotency-Key already names. `routed`: the route and reason that chose `model_name`. `job`:
        the id and deadline a batch's line gives its job; None when that job exists already."""
        now = time.time()
        ticket = await self.admission.check(
            model=model_name, priority=request.priority, timeout_s=request.timeout_s, now=now
        )
        job_id = job[0] if job is not None else uuid.uuid4().hex
        params = JobRequest(
            max_tokens=max_tokens,
            sampling=sampling,
            grammar=request.grammar,
            stop=tuple(stop),
            ignore_eos=request.ignore_eos,
            min_tokens=request.min_tokens,
            skip_special_tokens=request.skip_special_tokens,
        )
        deadline = now + request.timeout_s if request.timeout_s is not None else None
        if job is not None:
            deadline = job[1]
        record = JobRecord(
            id=job_id,
            status=JobStatus.QUEUED,
            model=model_name,
            tenant=tenant,
            priority=request.priority,
            created_at=now,
            request=params,
            prompt_ids=tuple(prompt_ids),
            prompt_tokens=len(prompt_ids),
            completion_tokens=0,
            text="",
            attempts=0,
            route=routed.get("route"),
            route_reason=routed.get("route_reason"),
            deadline=deadline,
            callback_url=callback.url if callback is not None else None,
            callback_events=tuple(callback.events) if callback is not None else None,
        )
        intake = intake_fields(
            job_id=job_id,
            model=model_name,
            prompt_tokens=len(prompt_ids),
            priority=request.priority,
            deadline=deadline,
            tenant=tenant,
            max_tokens=max_tokens,
        )
        written = await self.admission.write(
            ticket,
            record=record,
            intake=intake,
            idempotency=(idempotency[0], f"{job_id} {idempotency[1]}") if idempotency else None,
            callback_at=now if callback is not None else None,
        )
        if written.existed:
            return None
        if written.held is not None:
            assert idempotency is not None
            replayed = await self._replay(written.held, idempotency, tenant)
            if replayed is None:  # its job expired just now: the key was dropped, this write may go
                return await self._admit_and_write(
                    request,
                    tenant=tenant,
                    model_name=model_name,
                    prompt_ids=prompt_ids,
                    sampling=sampling,
                    max_tokens=max_tokens,
                    stop=stop,
                    callback=callback,
                    idempotency=idempotency,
                    routed=routed,
                )
            return replayed
        return record

    async def _replay(self, held: str | bytes, idempotency: tuple[str, str], tenant: str) -> Submitted | None:
        """The job an Idempotency-Key names; None when that job has expired (an ended job lives
        ended_job_ttl_s, less than its key may): the key is dropped and names nothing any more."""
        value = held.decode() if isinstance(held, bytes) else held
        job_id, _, held_hash = value.partition(" ")
        if held_hash != idempotency[1]:
            raise IdempotencyConflict(
                f"this Idempotency-Key was used for job {job_id} with a different request body",
                job_id=job_id,
            )
        try:
            return Submitted(await self.get(job_id, tenant=tenant), replayed=True)
        except JobNotFound:
            if await self.redis.exists(self.keys.job(job_id)):
                raise  # another tenant's job (digests are per tenant: not reachable, but never leak)
            await self._forget(keys={"lease": self.keys.idempotency(idempotency[0])}, args={"holder": value})
            return None

    async def cancel(
        self, job_id: str, *, tenant: str | None, reason: str = "cancelled by the client"
    ) -> JobRecord:
        """Move the job to `cancelled` and end its event stream; its workers drop it at their next step.
        A job of another tenant is 404, as if it did not exist (`tenant` None: no check, internal)."""
        if tenant is not None:
            await self.get(job_id, tenant=tenant)  # a job's tenant never changes: checked once, first
        applied, status = await self.store.cancel(job_id, reason=reason, life=self.settings.life)
        if not applied:
            if not status:
                raise JobNotFound(f"job {job_id!r} does not exist (or has expired)", job_id=job_id)
            raise JobFinished(f"job {job_id} has already ended: {status}", job_id=job_id, status=status)
        view = await self.get(job_id, tenant=None)
        metrics.job_ended(view.model, "cancelled", "cancelled")
        return view

    def cancel_soon(self, job_id: str, reason: str) -> None:
        """Cancel in the background (a client went away; nobody waits for the answer)."""

        async def run() -> None:
            try:
                await self.cancel(job_id, tenant=None, reason=reason)
                log.info("job %s cancelled: %s", job_id, reason)
            except (JobFinished, JobNotFound):
                pass
            except Exception:
                log.warning("could not cancel job %s", job_id, exc_info=True)

        task = asyncio.get_running_loop().create_task(run())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def check_messages(self, count: int) -> None:
        """Refuse a chat of more than MAX_CHAT_MESSAGES messages (422), before any work on them."""
        check_messages(count)

    async def get(self, job_id: str, *, tenant: str | None) -> JobRecord:
        """The job's record. A job of another tenant is 404 job_not_found, exactly as an unknown one
        (never 403: that would tell who has which job). `tenant` None: no check (the API's own reads
        of a job it has already checked or just made)."""
        record = await self.store.get(job_id)
        if record is None or (tenant is not None and record.tenant != tenant):
            raise JobNotFound(f"job {job_id!r} does not exist (or has expired)", job_id=job_id)
        return record

    async def events(
        self, job_id: str, after: str | None = None, *, slot: Slot | None = None
    ) -> AsyncIterator[Event]:
        """The job's events after entry id `after`: the backlog first, then the live tail, until the
        end. `slot` (the tenant's open-stream slot, `StreamSlots.take`) is given back when it ends."""
        try:
            async for event in self._events(job_id, after):
                yield event
        finally:
            if slot is not None:
                slot.release()

    async def _events(self, job_id: str, after: str | None) -> AsyncIterator[Event]:
        async for event in follow(self.store, job_id, after, wake=self.hub.watch, poll_s=POLL_FALLBACK_S):
            yield event

    async def is_over(self, job_id: str, after: str | None, *, tenant: str | None) -> bool:
        """True when the job has ended and nothing follows `after` in its stream (its final event
        was already delivered). Raises JobNotFound once the job has expired, or for another tenant."""
        if tenant is not None:
            await self.get(job_id, tenant=tenant)
        return await is_over(self.store, job_id, after)

    async def embed(
        self, texts: list[str], model: str | None, *, tenant: str
    ) -> tuple[list[list[float]], JobRecord]:
        """Run an embeddings job and return its vectors (one request on the tenant's request limit; no
        generated tokens). The job goes the way every job goes: admission, the intake, the batcher
        (which batches it with other embeddings jobs for the embeddings stage workers) and the
        monitor's stall recovery."""
        check_embeddings(self.settings, texts, model)
        await self.ratelimit.take_embedding(tenant, nbytes=padded_bytes(texts))  # the work, padded
        job_id = uuid.uuid4().hex
        await self._write_embedding(texts, tenant=tenant, job_id=job_id, priority="normal", deadline=None)
        done = await self.wait(job_id, self.sync_timeout_s)
        if not done.status.is_finished:
            done = await self._end_unanswered_embedding(job_id)
        if done.status == JobStatus.FAILED:
            raise JobFailed(f"embeddings job {job_id} failed: {done.error}", job_id=job_id)
        if done.status != JobStatus.SUCCEEDED or done.embedding is None:
            raise SyncTimeout(
                f"embeddings job {job_id} did not finish in {self.sync_timeout_s:g} s; it was cancelled",
                job_id=job_id,
            )
        # The vectors (up to a MB of JSON) go to this caller alone: the record keeps the rest.
        await self.store.forget_embedding(job_id)
        return json.loads(done.embedding), done

    async def submit_embedding_line(
        self, texts: list[str], model: str | None, *, tenant: str, job_id: str, deadline: float
    ) -> bool:
        """A batch's /v1/embeddings line as a `batch`-class embeddings job (as `submit_line`): False
        when a job with that id exists already. Its vectors stay on the record until the feeder has
        them (`AsyncJobStore.forget_embedding`)."""
        check_embeddings(self.settings, texts, model)
        return await self._write_embedding(
            texts, tenant=tenant, job_id=job_id, priority="batch", deadline=deadline
        )

    async def _write_embedding(
        self, texts: list[str], *, tenant: str, job_id: str, priority: str, deadline: float | None
    ) -> bool:
        """Admit and queue an embeddings job; False when a job with its id exists already."""
        now = time.time()
        ticket = await self.admission.check(model=EMBEDDING_MODEL, priority=priority, timeout_s=None, now=now)
        record = JobRecord(
            id=job_id,
            status=JobStatus.QUEUED,
            model=EMBEDDING_MODEL,
            tenant=tenant,
            kind=EMBEDDING,
            priority=priority,
            created_at=now,
            deadline=deadline,
            input=tuple(texts),
        )
        intake = intake_fields(
            job_id=job_id,
            model=EMBEDDING_MODEL,
            prompt_tokens=padded_positions(texts),
            priority=priority,
            deadline=deadline,
            tenant=tenant,
            kind=EMBEDDING,
        )
        written = await self.admission.write(ticket, record=record, intake=intake, idempotency=None)
        return not written.existed

    async def _end_unanswered_embedding(self, job_id: str) -> JobRecord:
        """An embeddings job's vectors go to its one request, so once that request stops waiting nobody
        can take them: the job is cancelled, with the reason (a stage worker that takes it later drops
        it), instead of staying queued or running until its record expires. One that ended meanwhile
        keeps its outcome, and is answered."""
        reason = (
            f"no embeddings stage finished it within {self.sync_timeout_s:g} s, the wait of its request; "
            "the request was answered 504"
        )
        with suppress(JobFinished):
            await self.cancel(job_id, tenant=None, reason=reason)
        return await self.get(job_id, tenant=None)

    async def wait(self, job_id: str, timeout_s: float) -> JobRecord:
        """The job's record once it has finished (or as it is when the timeout passes)."""
        deadline = time.monotonic() + timeout_s
        async with self.hub.watch(job_id) as woke:
            while True:
                woke.clear()
                record = await self.get(job_id, tenant=None)
                remaining = deadline - time.monotonic()
                if record.status.is_finished or remaining <= 0:
                    return record
                try:
                    await asyncio.wait_for(woke.wait(), min(remaining, POLL_FALLBACK_S))
                except TimeoutError:
                    pass
