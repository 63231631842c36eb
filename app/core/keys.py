"""Every Redis key, channel and queue name Conveyor uses, built in one place, each with its lifetime.

All names start with the namespace, so several stacks (or test runs) can share one Redis. Each
builder declares beside its name how its key stays bounded (`@lives`): a TTL, a cap on its length,
or what else bounds it (the jobs in flight, the catalog, a revocation). `Keys.lifetime_of` finds a
key's declaration from its name; a test walks every key a whole stack leaves in Redis and fails on
a key no builder declares, or one declared with a TTL that has none.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any, TypeVar

PRIORITIES = ("realtime", "high", "normal", "batch")  # strict order (with aging, batching/windows.py)
PRIORITY_ALIASES = {"low": "batch"}  # older name, still accepted at submit
BATCHER_GROUP = "batcher"
BATCH_LOG_MAXLEN = 10_000
CONTROL_MAXLEN = 1_000  # batch-finished notes wait here only until the batcher's next read

F = TypeVar("F", bound=Callable[..., str])


@dataclass(frozen=True)
class Lifetime:
    """How a key family stays bounded. `ttl` and `cap` name what sets them (a setting or a constant);
    `bound` says in words what bounds a key with neither."""

    ttl: str | None = None
    cap: str | None = None
    bound: str | None = None
    channel: bool = False  # a pub/sub channel: never stored

    def __post_init__(self) -> None:
        if not (self.ttl or self.cap or self.bound or self.channel):
            raise ValueError("a key family needs a TTL, a cap or a stated bound")


def lives(**lifetime: Any) -> Callable[[F], F]:
    """Declare a builder's lifetime beside its name (see `Lifetime`)."""

    def mark(builder: F) -> F:
        builder.lifetime = Lifetime(**lifetime)  # type: ignore[attr-defined]
        return builder

    return mark


_PART = "\x00"  # stands for each argument while a builder's name is turned into a pattern


@dataclass(frozen=True)
class Keys:
    namespace: str

    @classmethod
    def families(cls) -> dict[str, Lifetime]:
        """Builder name -> its declared lifetime, for every builder of a stored key or channel."""
        return {name: f.lifetime for name, f in vars(cls).items() if hasattr(f, "lifetime")}

    def lifetime_of(self, key: str) -> tuple[str, Lifetime] | None:
        """The builder whose names `key` is one of, and its lifetime; None for a key no builder makes."""
        for name, pattern in _patterns(self.namespace):
            if pattern.fullmatch(key):
                return name, getattr(Keys, name).lifetime
        return None

    @lives(ttl="job_ttl_s (ended_job_ttl_s once the job has ended)")
    def job(self, job_id: str) -> str:
        """Hash: the job record (status, request, timings, text)."""
        return f"{self.namespace}:job:{job_id}"

    @lives(ttl="job_ttl_s, as its job", cap="max_tokens_limit + EVENTS_BESIDE_TOKENS (Settings.lifetimes)")
    def events(self, job_id: str) -> str:
        """Stream: token / done / error events of one job, replayable by entry id."""
        return f"{self.namespace}:job:{job_id}:events"

    @lives(channel=True)
    def announce(self, job_id: str) -> str:
        """Pub/sub channel: 'a new event is in the stream' (a wake-up, never the data itself)."""
        return f"{self.namespace}:announce:{job_id}"

    def announce_pattern(self) -> str:
        return f"{self.namespace}:announce:*"

    def job_id_from_announce(self, channel: str) -> str:
        return channel.rsplit(":", 1)[1]

    @lives(bound="the jobs waiting: the batcher deletes each entry it dispatches (XACK, XDEL)")
    def intake(self, priority: str) -> str:
        """Stream, one per priority class, read by the batcher's consumer group."""
        return f"{self.namespace}:intake:{priority}"

    @lives(cap="CONTROL_MAXLEN")
    def control(self) -> str:
        """Stream: workers tell the batcher that a batch has finished."""
        return f"{self.namespace}:batcher:control"

    @lives(cap="BATCH_LOG_MAXLEN")
    def batch_log(self) -> str:
        """Stream: one entry per dispatched batch (id, model, size, bucket), capped."""
        return f"{self.namespace}:batches"

    @lives(bound="the batches in flight: a field leaves when its batch finishes or is recovered")
    def inflight(self, model: str) -> str:
        """Hash: batch id -> job ids, for batches dispatched and not yet finished."""
        return f"{self.namespace}:inflight:{model}"

    @lives(bound="the catalog's models")
    def inflight_models(self) -> str:
        """Set: the models that have had an `inflight` hash (added with each dispatch, never removed:
        bounded by the catalog), so the monitor walks them without scanning the keyspace."""
        return f"{self.namespace}:inflightmodels"

    @lives(bound="the unfinished scheduled or running jobs")
    def progress(self) -> str:
        """Sorted set: unfinished scheduled or running jobs, scored by their last sign of progress
        (dispatch, prefill start, a token). The batcher's monitor recovers the ones that stall."""
        return f"{self.namespace}:progress"

    @lives(ttl="10 x heartbeat_ttl_s from the last beat (workers/heartbeat.py)")
    def workers(self, model: str, stage: int) -> str:
        """Sorted set: live workers of one stage, scored by their last heartbeat (unix seconds)."""
        return f"{self.namespace}:workers:{model}:{stage}"

    @lives(ttl="10 x heartbeat_ttl_s from the last report; a worker's field as long as its heartbeat")
    def credit(self, model: str) -> str:
        """Hash: stage-0 worker -> what its step engine may still take (JSON, `app.core.credit`)."""
        return f"{self.namespace}:credit:{model}"

    @lives(ttl="10 x heartbeat_ttl_s from the last beat (workers/heartbeat.py)")
    def devices(self) -> str:
        """Hash: worker -> its GPU's memory, utilisation and temperature (JSON), from its heartbeat."""
        return f"{self.namespace}:devices"

    @lives(ttl="10 x heartbeat_ttl_s from the last beat (workers/heartbeat.py)")
    def stage_info(self) -> str:
        """Hash: worker -> what it serves (model, stage, layers, dtype, device, parameter bytes; JSON)."""
        return f"{self.namespace}:stageinfo"

    @lives(ttl="from each beat (workers/health.py)")
    def health(self) -> str:
        """Hash: stage worker -> its health record (JSON, app/core/health.py), from its heartbeat."""
        return f"{self.namespace}:health"

    @lives(ttl="3600 s from its last write (workers/latency.py)")
    def latency(self, model: str) -> str:
        """Hash: stage -> its measured step latency (JSON), for `conveyor plan --rebalance`."""
        return f"{self.namespace}:latency:{model}"

    def stage_queue(self, model: str, stage: int) -> str:
        """Celery queue shared by every replica of a stage of `model`'s pipeline: a generation
        model's prefill steps land here, and an embeddings model's batches, at every stage."""
        return f"{self.namespace}.stage.{model}.{stage}"

    @lives(ttl="the lane's TTL, renewed with each message (workers/lane.py)")
    def lane(self, model: str, stage: int, worker: str) -> str:
        """List: one replica's direct lane, for steps of batches whose KV cache it holds (workers/lane.py)."""
        return f"{self.namespace}:lane:{model}:{stage}:{worker}"

    # Admission (API)

    @lives(ttl="STATE_TTL_S (core/breaker.py)")
    def breaker(self, model: str) -> str:
        """Hash: the circuit breaker of one model's pipeline (state, opened_at, probe_until, since)."""
        return f"{self.namespace}:breaker:{model}"

    @lives(ttl="the breaker's window (core/breaker.py)")
    def outcomes(self, model: str, second: int) -> str:
        """Hash: jobs of one model that succeeded / failed within one second (unix), for the breaker."""
        return f"{self.namespace}:outcomes:{model}:{second}"

    @lives(ttl="STAGE_MARK_TTL_S (core/admission.py)")
    def stage_down(self, model: str, stage: int) -> str:
        """String: since when a stage with no heartbeat at all has been seen without a worker."""
        return f"{self.namespace}:stage-down:{model}:{stage}"

    @lives(bound="the jobs waiting in an intake stream")
    def tenant_waiting(self) -> str:
        """Sorted set, every score 0 (so ordered by member): one member per job waiting in an intake
        stream (`jobs.WAITING`), `{priority} {len(tenant)}:{tenant} {job id}`; a tenant's waiting jobs
        of a class are one range of it (ZLEXCOUNT, admission's tenant share). Written only by
        app/core/jobstore.py, beside the job's status; bounded by the jobs waiting."""
        return f"{self.namespace}:tenant-waiting"

    @lives(bound="the jobs waiting in an intake stream")
    def tenant_waiting_expiry(self) -> str:
        """Sorted set: the members of `tenant_waiting`, scored by when their job's record expires (unix
        ms), so that a record that expired while its job waited (no move took it out) is dropped too."""
        return f"{self.namespace}:tenant-waiting:expiry"

    @lives(ttl="job_ttl_s, as its job; once its job ends, at most the job's ended_job_ttl_s")
    def idempotency(self, digest: str) -> str:
        """String: `{job id} {body hash}` of the job an Idempotency-Key created (digest: its sha256).
        It expires with its job: the job store shortens it when the job ends (ENDED_FUNCTION)."""
        return f"{self.namespace}:idempotency:{digest}"

    @lives(ttl="job_ttl_s, renewed by each of the tenant's submits")
    def tenant_retained(self, tenant: str) -> str:
        """Sorted set: the tenant's jobs that Redis still holds, members `{bytes} {job id}` (what the
        job may weigh, `jobrecord.retained_bytes`), scored by when the job's record expires (unix ms;
        moved earlier when the job ends). Its quota (admission's retained-bytes gate). Written only
        by app/core/jobstore.py; a member leaves once its record has expired."""
        return f"{self.namespace}:tenant-retained:{tenant}"

    @lives(ttl="job_ttl_s, renewed with tenant_retained")
    def tenant_retained_bytes(self, tenant: str) -> str:
        """String: the sum of the bytes of `tenant_retained`'s members, kept with it."""
        return f"{self.namespace}:tenant-retained-bytes:{tenant}"

    # Webhooks (app/webhooks/)

    @lives(bound="the jobs with a callback_url until their final event (or job_ttl_s)")
    def webhook_jobs(self) -> str:
        """Sorted set: jobs with a callback_url whose events the dispatcher follows, scored by submit
        time; a member leaves after its final event (or after job_ttl_s)."""
        return f"{self.namespace}:webhooks:jobs"

    @lives(bound="the members of webhook_jobs")
    def webhook_cursors(self) -> str:
        """Hash: job id -> the last event-stream entry the dispatcher has handed on (its restart point)."""
        return f"{self.namespace}:webhooks:cursors"

    @lives(ttl="the dispatcher's lease (LEASE_S, webhooks/dispatcher.py)")
    def webhook_lease(self) -> str:
        """String: the dispatcher holding the lease (one dispatches at a time), with a short TTL."""
        return f"{self.namespace}:webhooks:dispatcher"

    @lives(ttl="job_ttl_s, as its job", cap="webhooks.delivery.LOG_MAX")
    def webhook_deliveries(self, job_id: str) -> str:
        """List: the job's delivery attempts (JSON, newest last), capped at delivery.LOG_MAX."""
        return f"{self.namespace}:job:{job_id}:deliveries"

    @lives(ttl="job_ttl_s, as its job")
    def webhook_outcomes(self, job_id: str) -> str:
        """Hash: webhook id -> how it ended (delivered, gave_up, disabled); duplicates are skipped."""
        return f"{self.namespace}:job:{job_id}:webhooks"

    @lives(ttl="webhooks.delivery.DISABLED_TTL_S, a week")
    def webhook_disabled(self, digest: str) -> str:
        """String: a tenant's callback URL that answered 410 Gone (digest: sha256 of the tenant and the
        URL, `webhooks.delivery.disabled_digest`); nothing more of that tenant's is sent to it."""
        return f"{self.namespace}:webhooks:disabled:{digest}"

    @lives(bound="the tenants given a key: as apikeys, until revoked")
    def webhook_tenants(self) -> str:
        """Hash: tenant -> its webhook secret's generation and rotation time (JSON; the secret itself is
        derived from the master key, never stored). `conveyor keys create` adds; no TTL, as `apikeys`."""
        return f"{self.namespace}:webhooks:tenants"

    @lives(bound="webhooks.retries.TENANT_MAX_RETRIES per tenant")
    def webhook_retries(self) -> str:
        """Sorted set: webhook id -> when its next attempt is due (unix seconds). The dispatcher sends the
        due ones to the callbacks queue; a retry lives here, not in a worker's memory."""
        return f"{self.namespace}:webhooks:retries"

    @lives(bound="the members of webhook_retries")
    def webhook_retry_messages(self) -> str:
        """Hash: webhook id -> the delivery message of its next attempt (JSON), beside `webhook_retries`."""
        return f"{self.namespace}:webhooks:retry-messages"

    @lives(bound="one field per tenant with retries waiting")
    def webhook_retry_counts(self) -> str:
        """Hash: tenant -> how many of its events wait in `webhook_retries` (the per-tenant retry cap)."""
        return f"{self.namespace}:webhooks:retry-counts"

    @lives(ttl="the latest slot's lapse", cap="webhooks.delivery.TENANT_CONCURRENCY")
    def webhook_slots(self, tenant: str) -> str:
        """Sorted set: one tenant's deliveries in progress, scored by when their slot lapses (a worker
        that died mid-attempt frees it then); at most webhooks.delivery.TENANT_CONCURRENCY members."""
        return f"{self.namespace}:webhooks:slots:{tenant}"

    def callbacks_queue(self) -> str:
        """Celery queue of webhook deliveries, served by the callbacks worker."""
        return f"{self.namespace}.callbacks"

    # Tenants (app/api/auth.py, app/core/ratelimit.py, app/api/audit.py)

    @lives(bound="the keys created and not revoked")
    def api_keys(self) -> str:
        """Hash: SHA-256 hex of an API key -> its tenant and creation time (JSON). `conveyor keys create`
        adds, `conveyor keys revoke` removes; no TTL: a key lives until it is revoked."""
        return f"{self.namespace}:apikeys"

    @lives(ttl="RECORD_TTL_S from the last record (api/authmode.py)")
    def api_auth(self) -> str:
        """Sorted set: `{auth mode} {api process}` -> when that API process last recorded how it serves
        (unix seconds; `CONVEYOR_AUTH`, `keys` or `none`), so that `conveyor keys create` can tell
        whether the API it makes a key for checks keys at all. Written only by app/api/authmode.py."""
        return f"{self.namespace}:api-auth"

    @lives(ttl="until the tenant's bucket is full again (core/ratelimit.py)")
    def rate_limit(self, tenant: str) -> str:
        """Hash: one tenant's rate-limit state (GCRA theoretical arrival times, ms); expires when full."""
        return f"{self.namespace}:ratelimit:{tenant}"

    @lives(cap="audit_maxlen")
    def audit(self) -> str:
        """Stream: one entry per API request (tenant, method, path, status, ...), capped at audit_maxlen."""
        return f"{self.namespace}:audit"

    @lives(cap="api.audit.UNAUTHENTICATED_MAXLEN")
    def audit_unauthenticated(self) -> str:
        """Stream: the entries of requests refused before a tenant was known (401s), capped apart at
        UNAUTHENTICATED_MAXLEN so that a flood of them cannot roll the tenants' entries over."""
        return f"{self.namespace}:audit:unauthenticated"

    # Files and batches (OpenAI's Batch API: app/core/batchstore.py)

    @lives(ttl="batchstore.FILE_TTL_S")
    def file(self, file_id: str) -> str:
        """Hash: an uploaded or a batch's output file's record (tenant, name, purpose, bytes, times)."""
        return f"{self.namespace}:file:{file_id}"

    @lives(ttl="batchstore.FILE_TTL_S, as its record")
    def file_content(self, file_id: str) -> str:
        """String: a file's bytes (JSONL)."""
        return f"{self.namespace}:file:{file_id}:content"

    @lives(ttl="batchstore.FILE_TTL_S from the tenant's latest upload")
    def tenant_files(self, tenant: str) -> str:
        """Hash: file id -> `{bytes} {expiry, unix ms}` of one tenant's uploads: its byte quota."""
        return f"{self.namespace}:tenant-files:{tenant}"

    @lives(ttl="batchstore.FILE_TTL_S")
    def batch(self, batch_id: str) -> str:
        """Hash: a batch's record (status, counts, timestamps, files, feeding cursor)."""
        return f"{self.namespace}:batch:{batch_id}"

    @lives(ttl="batchstore.FILE_TTL_S, as its batch")
    def batch_lines(self, batch_id: str) -> str:
        """List: a batch's validated input lines (custom_id and body, JSON), in input order."""
        return f"{self.namespace}:batch:{batch_id}:lines"

    @lives(ttl="batchstore.FILE_TTL_S, as its batch")
    def batch_results(self, batch_id: str) -> str:
        """Hash: line index -> its output or error line (JSON), collected as its job ends."""
        return f"{self.namespace}:batch:{batch_id}:results"

    @lives(ttl="batchstore.FILE_TTL_S from the tenant's latest batch")
    def tenant_batches(self, tenant: str) -> str:
        """Sorted set: one tenant's batch ids, scored by creation time (GET /v1/batches)."""
        return f"{self.namespace}:tenant-batches:{tenant}"

    @lives(ttl="batchstore.FILE_TTL_S from the latest batch", bound="the batches not yet ended")
    def open_batches(self) -> str:
        """Sorted set: batches the feeder still works on (validating to finalizing), by creation time."""
        return f"{self.namespace}:open-batches"

    @lives(bound="the ended batches with a callback_url, each until the next feeder pass")
    def batches_to_announce(self) -> str:
        """Set: ended batches with a callback_url whose end the feeder has not yet handed to the webhook
        retry queue (it does so, then removes them: a crash in between hands one twice, and the
        event's id settles once)."""
        return f"{self.namespace}:batches-to-announce"

    @lives(ttl="the feeder's lease (LEASE_S, api/batchfeed.py)")
    def batch_feeder(self) -> str:
        """String: the API process feeding batches' lines (one at a time), with a short TTL."""
        return f"{self.namespace}:batch-feeder"


@cache
def _patterns(namespace: str) -> tuple[tuple[str, re.Pattern[str]], ...]:
    keys = Keys(namespace)
    found = []
    for name in Keys.families():
        builder = getattr(keys, name)
        arguments = [_PART] * (len(inspect.signature(builder).parameters))
        example = re.escape(builder(*arguments)).replace(re.escape(_PART), "[^:]+")
        found.append((name, re.compile(example)))
    return tuple(found)
