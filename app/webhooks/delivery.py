"""One delivery of one webhook event: take a tenant slot, check, sign, POST, judge, record, schedule
the retry.

Called by the callbacks worker's Celery task (app/webhooks/worker.py) with a message from the
dispatcher (a first attempt, or a retry come due). Rules:

- A tenant has at most TENANT_CONCURRENCY deliveries in progress (app/webhooks/retries.py
  `TenantSlots`); a message whose tenant has none free waits in Redis and comes back (not counted as
  an attempt), so a tenant whose receiver hangs holds that many threads and the others keep theirs.
- An attempt has one wall-clock deadline, ATTEMPT_DEADLINE_S (connect, TLS, send, read;
  app/webhooks/ssrf.py), and tries at most three of the name's addresses.
- 2xx: delivered. The event's id is marked settled; a duplicate of it (a dispatcher restart) is skipped.
- 410 Gone: the URL is disabled for the event's tenant (DISABLED_TTL_S); nothing more of
  that tenant's is sent to it, and its submits naming it are refused (422, reason `endpoint_disabled`).
  Other tenants' callbacks to the same URL go on: a tenant's receiver cannot switch off another's.
- anything else (another status, a timeout, a refused connection, a URL the SSRF guard now refuses
  because its DNS changed): retried after base x 2^(n-1) seconds, jittered into the upper half
  ([d/2, d], so delays grow while retries of many events spread out), or after the receiver's
  `Retry-After` when that is longer; never longer than BACKOFF_MAX_S. After
  MAX_ATTEMPTS attempts the event is given up. The retry waits in Redis (`RetryQueue`),
  and is given up too when TENANT_MAX_RETRIES (app/webhooks/retries.py) of its tenant's events wait
  already.
- Redirects are not followed (a redirect is a failure: it could lead anywhere).

Every attempt (time, status or error, duration, outcome, the delay before the next) is appended to
the job's delivery log (its newest LOG_MAX), which `GET /v1/jobs/{id}/deliveries` lists.
"""

from __future__ import annotations

import email.utils
import enum
import hashlib
import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from app.core.config import WebhookSettings
from app.core.keys import Keys
from app.webhooks import signing
from app.webhooks.retries import RetryQueue, TenantSlots, tenant_of
from app.webhooks.ssrf import CallbackRefused, Deadline, Guard, Target, pinned_transport

DELIVER_TASK = "conveyor.webhooks.deliver"
USER_AGENT = "Conveyor-Webhooks/0.1"
SLOT_MARGIN_S = 60.0  # a slot outlives its attempt's deadline by this (DNS, recording) before it lapses
# Deliveries of one tenant in progress at once, over all callbacks workers: a tenant whose receiver
# hangs holds this many threads at most and the others keep theirs (webhook_concurrency is 8).
TENANT_CONCURRENCY = 2
# Wall-clock limit of one attempt, connect + TLS + send + read together (and of each of them): a
# receiver that never answers, or trickles a byte a second, holds a delivery thread this long at most.
ATTEMPT_DEADLINE_S = 10.0
LOG_MAX = 256  # delivery attempts kept per job (the newest)
# A 410 Gone disables its URL this long: a week, then a URL reused by someone else may try again.
DISABLED_TTL_S = 7 * 86_400
# Attempts of one event (the first included), spaced BACKOFF_BASE_S x 2^(n-1) with jitter: 21 to 42
# minutes of retries, no delay over BACKOFF_MAX_S (a receiver's Retry-After included). Retries wait
# in Redis, not in a worker's memory.
MAX_ATTEMPTS = 10
BACKOFF_BASE_S = 5.0  # the first retry after 2.5 to 5 s
BACKOFF_MAX_S = 1800.0


class Outcome(enum.StrEnum):
    DELIVERED = "delivered"
    RETRYING = "retrying"
    GAVE_UP = "gave_up"
    DISABLED = "disabled"  # this attempt got 410 Gone
    SKIPPED = "skipped"  # not attempted: the endpoint had been disabled


@dataclass(frozen=True)
class Attempt:
    """One line of a job's delivery log."""

    webhook_id: str
    type: str
    attempt: int
    at: float  # unix time the attempt started
    url: str
    status_code: int | None
    error: str | None
    duration_ms: float
    outcome: str
    retry_in_s: float | None = None  # the delay before the next attempt, when there is one
    next_attempt_at: float | None = None

    def encode(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))


def url_digest(url: str) -> str:
    return hashlib.sha256(url.encode()).hexdigest()


def disabled_digest(tenant: str, url: str) -> str:
    """What names a tenant's disabled callback URL (`Keys.webhook_disabled`): the tenant and the URL,
    the tenant's length first so that no two pairs read alike."""
    return url_digest(f"{len(tenant)}:{tenant} {url}")


def backoff_s(
    attempt: int, *, base_s: float, max_s: float, rand: Callable[[], float] = random.random
) -> float:
    """Delay after failed attempt `attempt` (1-based): d = base x 2^(n-1), jittered in [d/2, d], then
    capped (capping last keeps the sequence from shrinking however the jitter falls)."""
    full = base_s * 2 ** min(attempt - 1, 60)
    return min(max_s, full / 2 + rand() * full / 2)


def retry_after_s(value: str | None, *, now: float) -> float | None:
    """A `Retry-After` header (seconds or an HTTP date) as seconds from now; None if absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - now)


class Deliverer:
    """Makes attempts; shared by the callbacks worker's threads (the Redis client is thread-safe)."""

    def __init__(
        self,
        redis: Any,
        keys: Keys,
        settings: WebhookSettings,
        *,
        guard: Guard,
        secrets: signing.SecretSource,
        job_ttl_s: int,  # a job's delivery log lives as long as the job may
        clock: Callable[[], float] = time.time,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.settings = settings
        self.job_ttl_s = job_ttl_s
        self.guard = guard
        self.secrets = secrets
        self.clock = clock
        self.rand = rand
        self.retries = RetryQueue(redis, keys)
        self.slots = TenantSlots(
            redis,
            keys,
            per_tenant=TENANT_CONCURRENCY,
            hold_s=ATTEMPT_DEADLINE_S + SLOT_MARGIN_S,
        )

    def deliver(self, message: dict[str, Any]) -> None:
        """Deliver the event in `message` (attempt `message["attempt"]`, 1 when absent) if its tenant
        has a slot free, and schedule what comes next in Redis: the retry, or this message again once
        a slot may be free. Never waits for another tenant, nor longer than one attempt's deadline."""
        number = int(message.get("attempt", 1))
        tenant = tenant_of(message)
        token = self.slots.acquire(tenant, now=self.clock())
        if token is None:
            # Half to all of a deadline: a slot frees by then, and the waiting events spread out.
            wait = ATTEMPT_DEADLINE_S * (0.5 + self.rand() / 2)
            if not self.retries.schedule(message, due=self.clock() + wait):
                self._refused(message, number)
            return
        try:
            delay = self.attempt(message, number)
        finally:
            self.slots.release(tenant, token)
        if delay is not None and not self.retries.schedule(
            {**message, "attempt": number + 1}, due=self.clock() + delay
        ):
            self._refused(message, number)

    def _refused(self, message: dict[str, Any], number: int) -> None:
        cap = self.retries.max_per_tenant
        error = f"given up: {cap} of this tenant's webhook events already wait for a retry"
        self._record(message, number, self.clock(), None, error, Outcome.GAVE_UP)

    def attempt(self, message: dict[str, Any], number: int) -> float | None:
        """Make attempt `number` (1-based) of the event in `message`; the delay before the next attempt,
        or None when the event is settled (delivered, disabled, given up, or a duplicate)."""
        job_id, webhook_id, url = message["job_id"], message["webhook_id"], message["url"]
        if self.redis.hget(self.keys.webhook_outcomes(job_id), webhook_id) is not None:
            return None  # sent twice by a restarted dispatcher: the first copy settled it
        started = self.clock()
        disabled = self.keys.webhook_disabled(disabled_digest(tenant_of(message), url))
        if self.redis.exists(disabled):
            self._record(
                message, number, started, None, "endpoint disabled: it answered 410 Gone", Outcome.SKIPPED
            )
            return None
        status, error, retry_after = None, None, None
        deadline = Deadline(ATTEMPT_DEADLINE_S)  # DNS spends from it too
        try:
            status, retry_after = self._post(self.guard.check(url), message, started, deadline)
        except CallbackRefused as exc:
            error = f"refused ({exc.reason}): {exc.message}"
        except httpx.HTTPError as exc:
            error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if status is not None and 200 <= status < 300:
            self._record(message, number, started, status, None, Outcome.DELIVERED)
            return None
        if status == 410:
            self.redis.set(disabled, repr(self.clock()), ex=DISABLED_TTL_S)
            self._record(message, number, started, status, None, Outcome.DISABLED)
            return None
        if number >= MAX_ATTEMPTS:
            self._record(message, number, started, status, error, Outcome.GAVE_UP)
            return None
        delay = self.delay(number, retry_after, now=self.clock())
        self._record(message, number, started, status, error, Outcome.RETRYING, delay)
        return delay

    def delay(self, number: int, retry_after: str | None, *, now: float) -> float:
        wait = backoff_s(number, base_s=BACKOFF_BASE_S, max_s=BACKOFF_MAX_S, rand=self.rand)
        asked = retry_after_s(retry_after, now=now)
        if asked is not None:
            wait = max(wait, asked)
        return min(wait, BACKOFF_MAX_S)

    def _post(
        self, target: Target, message: dict[str, Any], started: float, deadline: Deadline
    ) -> tuple[int, str | None]:
        payload = message["body"].encode()
        headers = signing.headers(
            message["webhook_id"], int(started), payload, self.secrets.for_tenant(message.get("tenant"))
        )
        headers["user-agent"] = USER_AGENT
        with (
            httpx.Client(
                transport=pinned_transport(target, deadline=deadline),
                timeout=ATTEMPT_DEADLINE_S,
                follow_redirects=False,
                trust_env=False,
            ) as client,
            client.stream("POST", target.url, content=payload, headers=headers) as response,
        ):
            return response.status_code, response.headers.get("retry-after")  # the body is not read

    def _record(
        self,
        message: dict[str, Any],
        number: int,
        started: float,
        status: int | None,
        error: str | None,
        outcome: Outcome,
        retry_in_s: float | None = None,
    ) -> None:
        now = self.clock()
        entry = Attempt(
            webhook_id=message["webhook_id"],
            type=message["type"],
            attempt=number,
            at=started,
            url=message["url"],
            status_code=status,
            error=error,
            duration_ms=round((now - started) * 1000, 1),
            outcome=str(outcome),
            retry_in_s=round(retry_in_s, 3) if retry_in_s is not None else None,
            next_attempt_at=now + retry_in_s if retry_in_s is not None else None,
        )
        job_id, ttl = message["job_id"], self.job_ttl_s
        log_key, outcomes = self.keys.webhook_deliveries(job_id), self.keys.webhook_outcomes(job_id)
        pipe = self.redis.pipeline(transaction=True)
        pipe.rpush(log_key, entry.encode())
        pipe.ltrim(log_key, -LOG_MAX, -1)
        pipe.expire(log_key, ttl)
        if outcome != Outcome.RETRYING:
            pipe.hset(outcomes, message["webhook_id"], str(outcome))
            pipe.expire(outcomes, ttl)
        pipe.execute()


def decode_log(raw: list[Any]) -> list[dict[str, Any]]:
    return [json.loads(item) for item in raw]
