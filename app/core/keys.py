"""Every Redis key, channel and queue name Conveyor uses, built in one place.

All names start with the namespace, so several stacks (or test runs) can share one Redis.
Every per-job key expires (`Settings.job_ttl_s`); the intake streams and the batch log are capped.
"""

from __future__ import annotations

from dataclasses import dataclass

PRIORITIES = ("realtime", "high", "normal", "batch")  # strict order (with aging, batching/windows.py)
PRIORITY_ALIASES = {"low": "batch"}  # older name, still accepted at submit
BATCHER_GROUP = "batcher"
BATCH_LOG_MAXLEN = 10_000


@dataclass(frozen=True)
class Keys:
    namespace: str

    def job(self, job_id: str) -> str:
        """Hash: the job record (status, request, timings, text)."""
        return f"{self.namespace}:job:{job_id}"

    def events(self, job_id: str) -> str:
        """Stream: token / done / error events of one job, replayable by entry id."""
        return f"{self.namespace}:job:{job_id}:events"

    def announce(self, job_id: str) -> str:
        """Pub/sub channel: 'a new event is in the stream' (a wake-up, never the data itself)."""
        return f"{self.namespace}:announce:{job_id}"

    def announce_pattern(self) -> str:
        return f"{self.namespace}:announce:*"

    def job_id_from_announce(self, channel: str) -> str:
        return channel.rsplit(":", 1)[1]

    def intake(self, priority: str) -> str:
        """Stream, one per priority class, read by the batcher's consumer group."""
        return f"{self.namespace}:intake:{priority}"

    def control(self) -> str:
        """Stream: workers tell the batcher that a batch has finished."""
        return f"{self.namespace}:batcher:control"

    def batch_log(self) -> str:
        """Stream: one entry per dispatched batch (id, model, size, bucket), capped."""
        return f"{self.namespace}:batches"

    def inflight(self, model: str) -> str:
        """Hash: batch id -> job ids, for batches dispatched and not yet finished."""
        return f"{self.namespace}:inflight:{model}"

    def inflight_models(self) -> str:
        """Set: the models that have had an `inflight` hash (added with each dispatch, never removed:
        bounded by the catalog), so the monitor walks them without scanning the keyspace."""
        return f"{self.namespace}:inflightmodels"

    def progress(self) -> str:
        """Sorted set: unfinished scheduled or running jobs, scored by their last sign of progress
        (dispatch, prefill start, a token). The batcher's monitor recovers the ones that stall."""
        return f"{self.namespace}:progress"

    def workers(self, model: str, stage: int) -> str:
        """Sorted set: live workers of one stage, scored by their last heartbeat (unix seconds)."""
        return f"{self.namespace}:workers:{model}:{stage}"

    def devices(self) -> str:
        """Hash: worker -> its GPU's memory, utilisation and temperature (JSON), from its heartbeat."""
        return f"{self.namespace}:devices"

    def stage_info(self) -> str:
        """Hash: worker -> what it serves (model, stage, layers, dtype, device, parameter bytes; JSON)."""
        return f"{self.namespace}:stageinfo"

    def health(self) -> str:
        """Hash: stage worker -> its health record (JSON, app/core/health.py), from its heartbeat."""
        return f"{self.namespace}:health"

    def latency(self, model: str) -> str:
        """Hash: stage -> its measured step latency (JSON), for `conveyor plan --rebalance`."""
        return f"{self.namespace}:latency:{model}"

    def stage_queue(self, model: str, stage: int) -> str:
        """Celery queue shared by every replica of a stage: prefill steps land here."""
        return f"{self.namespace}.stage.{model}.{stage}"

    def embed_queue(self, stage: int) -> str:
        """Celery queue of one stage of the embeddings pipeline."""
        return f"{self.namespace}.embed.{stage}"

    def lane(self, model: str, stage: int, worker: str) -> str:
        """List: one replica's direct lane, for steps of batches whose KV cache it holds (workers/lane.py)."""
        return f"{self.namespace}:lane:{model}:{stage}:{worker}"

    # Admission (API)

    def breaker(self, model: str) -> str:
        """Hash: the circuit breaker of one model's pipeline (state, opened_at, probe_until, since)."""
        return f"{self.namespace}:breaker:{model}"

    def outcomes(self, model: str, second: int) -> str:
        """Hash: jobs of one model that succeeded / failed within one second (unix), for the breaker."""
        return f"{self.namespace}:outcomes:{model}:{second}"

    def stage_down(self, model: str, stage: int) -> str:
        """String: since when a stage with no heartbeat at all has been seen without a worker."""
        return f"{self.namespace}:stage-down:{model}:{stage}"

    def tenant_waiting(self) -> str:
        """Sorted set, every score 0 (so ordered by member): one member per job waiting in an intake
        stream (`jobs.WAITING`), `{priority} {len(tenant)}:{tenant} {job id}`; a tenant's waiting jobs
        of a class are one range of it (ZLEXCOUNT, admission's tenant share). Written only by
        app/core/jobstore.py, beside the job's status; bounded by the jobs waiting."""
        return f"{self.namespace}:tenant-waiting"

    def tenant_waiting_expiry(self) -> str:
        """Sorted set: the members of `tenant_waiting`, scored by when their job's record expires (unix
        ms), so that a record that expired while its job waited (no move took it out) is dropped too."""
        return f"{self.namespace}:tenant-waiting:expiry"

    def idempotency(self, digest: str) -> str:
        """String: `{job id} {body hash}` of the job an Idempotency-Key created (digest: its sha256)."""
        return f"{self.namespace}:idempotency:{digest}"

    # Webhooks (app/webhooks/)

    def webhook_jobs(self) -> str:
        """Sorted set: jobs with a callback_url whose events the dispatcher follows, scored by submit
        time; a member leaves after its final event (or after job_ttl_s)."""
        return f"{self.namespace}:webhooks:jobs"

    def webhook_cursors(self) -> str:
        """Hash: job id -> the last event-stream entry the dispatcher has handed on (its restart point)."""
        return f"{self.namespace}:webhooks:cursors"

    def webhook_lease(self) -> str:
        """String: the dispatcher holding the lease (one dispatches at a time), with a short TTL."""
        return f"{self.namespace}:webhooks:dispatcher"

    def webhook_deliveries(self, job_id: str) -> str:
        """List: the job's delivery attempts (JSON, newest last), capped at webhook_log_max."""
        return f"{self.namespace}:job:{job_id}:deliveries"

    def webhook_outcomes(self, job_id: str) -> str:
        """Hash: webhook id -> how it ended (delivered, gave_up, disabled); duplicates are skipped."""
        return f"{self.namespace}:job:{job_id}:webhooks"

    def webhook_disabled(self, url_digest: str) -> str:
        """String: a callback URL (its sha256) that answered 410 Gone; nothing is sent to it."""
        return f"{self.namespace}:webhooks:disabled:{url_digest}"

    def webhook_tenants(self) -> str:
        """Hash: tenant -> its webhook secret's generation and rotation time (JSON; the secret itself is
        derived from the master key, never stored). `conveyor keys create` adds; no TTL, as `apikeys`."""
        return f"{self.namespace}:webhooks:tenants"

    def webhook_retries(self) -> str:
        """Sorted set: webhook id -> when its next attempt is due (unix seconds). The dispatcher sends the
        due ones to the callbacks queue; a retry lives here, not in a worker's memory."""
        return f"{self.namespace}:webhooks:retries"

    def webhook_retry_messages(self) -> str:
        """Hash: webhook id -> the delivery message of its next attempt (JSON), beside `webhook_retries`."""
        return f"{self.namespace}:webhooks:retry-messages"

    def webhook_retry_counts(self) -> str:
        """Hash: tenant -> how many of its events wait in `webhook_retries` (the per-tenant retry cap)."""
        return f"{self.namespace}:webhooks:retry-counts"

    def webhook_slots(self, tenant: str) -> str:
        """Sorted set: one tenant's deliveries in progress, scored by when their slot lapses (a worker
        that died mid-attempt frees it then); at most webhook_tenant_concurrency members."""
        return f"{self.namespace}:webhooks:slots:{tenant}"

    def callbacks_queue(self) -> str:
        """Celery queue of webhook deliveries, served by the callbacks worker."""
        return f"{self.namespace}.callbacks"

    # Tenants (app/api/auth.py, app/core/ratelimit.py, app/api/audit.py)

    def api_keys(self) -> str:
        """Hash: SHA-256 hex of an API key -> its tenant and creation time (JSON). `conveyor keys create`
        adds, `conveyor keys revoke` removes; no TTL: a key lives until it is revoked."""
        return f"{self.namespace}:apikeys"

    def rate_limit(self, tenant: str) -> str:
        """Hash: one tenant's rate-limit state (GCRA theoretical arrival times, ms); expires when full."""
        return f"{self.namespace}:ratelimit:{tenant}"

    def audit(self) -> str:
        """Stream: one entry per API request (tenant, method, path, status, ...), capped at audit_maxlen."""
        return f"{self.namespace}:audit"

    def audit_unauthenticated(self) -> str:
        """Stream: the entries of requests refused before a tenant was known (401s), capped apart at
        audit_unauthenticated_maxlen so that a flood of them cannot roll the tenants' entries over."""
        return f"{self.namespace}:audit:unauthenticated"
