"""The webhook dispatcher: follows the event streams of jobs with a callback, enqueues deliveries.

A submit with a `callback_url` adds the job to the `webhooks:jobs` sorted set in the same script
that queues it (app/core/admission.py), so no accepted job is missed. This process (one at a time,
by a lease in Redis; `conveyor webhooks dispatcher`, started by `conveyor up`) reads those jobs'
streams with XREAD from a cursor kept in Redis, maps the events (app/webhooks/events.py) and sends
one Celery task per webhook event to the callbacks queue. The cursor moves only after the tasks
are sent, and never past tokens still held for a batch, so a restart re-reads what it had not
handed on; a webhook event sent twice has the same id, and the delivery task skips an id already
delivered. After a job's final event it leaves the set (and jobs older than `job_ttl_s` are pruned).

It also sends the retries that have come due (app/webhooks/retries.py): the callbacks worker puts
an event's next attempt in Redis, and this loop hands it back to the callbacks queue at its time.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from app.core.config import Settings, WebhookSettings
from app.core.jobrecord import JobRecord
from app.core.jobs import FINAL_EVENTS
from app.core.jobview import JobPublic
from app.core.keys import Keys
from app.core.scripts import HOLD_LEASE, Script
from app.webhooks import events as ev
from app.webhooks.retries import RetryQueue

log = logging.getLogger(__name__)

LEASE_S = 10.0  # a dispatcher that died is replaced this long after its last renewal
BLOCK_MAX_S = 0.25  # XREAD blocks at most this long: newly registered jobs are picked up this soon
IDLE_S = 0.25  # nothing to follow: look at the set again after this
STREAMS_PER_READ = 500  # streams in one XREAD; past one read, reads do not block
ENTRIES_PER_STREAM = 256
MAX_FOLLOWED = 20_000  # the oldest this many registered jobs are followed; the rest wait their turn
RETRIES_PER_STEP = 1000  # due retries sent per step; more wait for the next (a quarter second on)
TOKEN_INTERVAL_S = 0.5  # `token` events of a job batched this long: at most two token webhooks a second


@dataclass
class Follow:
    """One followed job: where its callback goes, what it wants, how far it was read."""

    url: str
    events: frozenset[str]
    tenant: str | None
    read: str  # the last stream entry read (in memory)
    handled: str | None  # the last entry whose webhook events were all sent (the saved cursor)
    started: bool = False


class Dispatcher:
    def __init__(
        self,
        redis: Any,
        keys: Keys,
        settings: WebhookSettings,
        send: Callable[[dict[str, Any]], None],
        *,
        job_ttl_s: int,  # a job's deliveries live as long as it may; the dispatcher follows it no longer
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.settings = settings
        self.job_ttl_s = job_ttl_s
        self.send = send
        self.clock = clock
        self.me = uuid.uuid4().hex
        self.follows: dict[str, Follow] = {}
        self.batches = ev.TokenBatches(TOKEN_INTERVAL_S)
        self._hold = Script(redis, HOLD_LEASE)
        self.retries = RetryQueue(redis, keys)

    def run(self, stop: threading.Event) -> None:
        """Loop until `stop`; a failure (Redis away, a bug on one job) is logged and the state is read
        again from Redis: the loop never dies."""
        while not stop.is_set():
            try:
                if not self._lease():
                    self._forget()
                    stop.wait(1.0)
                    continue
                self.step()
            except Exception:
                log.exception("webhook dispatcher step failed; resuming from the saved cursors")
                self._forget()
                stop.wait(1.0)

    def _lease(self) -> bool:
        args = {"holder": self.me, "ms": int(LEASE_S * 1000)}
        return bool(self._hold(keys={"lease": self.keys.webhook_lease()}, args=args))

    def _forget(self) -> None:
        self.follows.clear()
        self.batches.open.clear()

    def step(self) -> None:
        """Send the retries due; read what the followed streams have, send the webhook events due, save
        the cursors."""
        self.send_due_retries()
        self._refresh()
        if not self.follows:
            time.sleep(IDLE_S)
            return
        now = self.clock()
        wait = self.batches.next_due_in(now)
        block = BLOCK_MAX_S if wait is None else min(BLOCK_MAX_S, wait)
        out: list[ev.Outgoing] = []
        finished: list[str] = []
        for entries in self._read(block):
            for stream, items in entries:
                job_id = self._job_of(stream)
                follow = self.follows.get(job_id)
                if follow is None:
                    continue
                for entry_id, fields in items:
                    if self._handle(job_id, follow, _text(entry_id), fields, out):
                        finished.append(job_id)
                        break
        now = self.clock()
        for job_id in self.batches.due(now):
            batch = self.batches.take(job_id)
            if batch is not None and job_id in self.follows:
                out.append(ev.token_event(job_id, batch))
                self.follows[job_id].handled = self.follows[job_id].read
        self._send(out)
        self._save(finished)

    def send_due_retries(self) -> int:
        """Hand the retries due by now to the callbacks queue, then forget them (a crash in between
        sends them twice: the event's id settles once)."""
        due = self.retries.due(self.clock(), RETRIES_PER_STEP)
        for message, _ in due:
            self.send(message)
        self.retries.remove(due)
        if due:
            log.info("sent %d webhook retries", len(due))
        return len(due)

    def _refresh(self) -> None:
        """Follow newly registered jobs from their saved cursors; prune the set of expired ones."""
        now = self.clock()
        expired = self.redis.zrangebyscore(self.keys.webhook_jobs(), "-inf", now - self.job_ttl_s)
        if expired:
            self._drop([_text(j) for j in expired])
        registered = [_text(j) for j in self.redis.zrange(self.keys.webhook_jobs(), 0, MAX_FOLLOWED - 1)]
        new = [j for j in registered if j not in self.follows]
        if not new:
            return
        pipe = self.redis.pipeline(transaction=False)
        for job_id in new:
            pipe.hmget(self.keys.job(job_id), ["callback_url", "callback_events", "tenant"])
        pipe.hmget(self.keys.webhook_cursors(), new)
        *records, cursors = pipe.execute()
        gone = []
        for job_id, (url, kinds, tenant), cursor in zip(new, records, cursors, strict=True):
            if url is None:  # the job expired (or was never written): nothing to follow
                gone.append(job_id)
                continue
            saved = _text(cursor) if cursor is not None else None
            self.follows[job_id] = Follow(
                url=_text(url),
                events=ev.parse_events(_text(kinds) if kinds is not None else None),
                tenant=_text(tenant) if tenant is not None else None,
                read=saved or "0-0",
                handled=saved,
                started=saved is not None and saved != "0-0",
            )
        if gone:
            self._drop(gone)

    def _read(self, block_s: float) -> list[Any]:
        jobs = list(self.follows.items())
        chunks = [jobs[i : i + STREAMS_PER_READ] for i in range(0, len(jobs), STREAMS_PER_READ)]
        replies = []
        for chunk in chunks:
            streams = {self.keys.events(job_id): f.read for job_id, f in chunk}
            blocking = len(chunks) == 1 and block_s > 0
            reply = self.redis.xread(
                streams, count=ENTRIES_PER_STREAM, block=max(1, int(block_s * 1000)) if blocking else None
            )
            if reply:
                replies.append(reply)
        if not replies and len(chunks) > 1:
            time.sleep(block_s)
        return replies

    def _handle(
        self, job_id: str, follow: Follow, entry_id: str, fields: Any, out: list[ev.Outgoing]
    ) -> bool:
        """Map one stream entry; True when it was the job's final event."""
        follow.read = entry_id
        event = _text(fields[b"event"])
        if event == "token":
            token = json.loads(fields[b"data"])
            if not follow.started:
                follow.started = True
                if "started" in follow.events:
                    data = ev.started_data(self._job(job_id))
                    out.append(
                        ev.Outgoing(
                            job_id,
                            ev.webhook_id(job_id, "started"),
                            "started",
                            ev.body("started", ev.entry_time(entry_id), data),
                        )
                    )
            if "token" in follow.events:
                self.batches.add(job_id, entry_id, token, now=self.clock(), cursor=follow.handled)
            if self.batches.holding(job_id) is None:
                follow.handled = entry_id
            return False
        if event not in FINAL_EVENTS:
            follow.handled = entry_id
            return False
        batch = self.batches.take(job_id)
        if batch is not None:
            out.append(ev.token_event(job_id, batch))
        kind = ev.kind_of_final(event)
        if kind in follow.events:
            body = ev.body(kind, ev.entry_time(entry_id), self._job(job_id))
            out.append(ev.Outgoing(job_id, ev.webhook_id(job_id, kind), kind, body))
        follow.handled = entry_id
        return True

    def _job(self, job_id: str) -> dict[str, Any]:
        raw = self.redis.hgetall(self.keys.job(job_id))
        if not raw:
            return {"id": job_id}
        return JobPublic.from_record(JobRecord.from_hash(raw)).model_dump(mode="json")

    def _send(self, out: list[ev.Outgoing]) -> None:
        for item in out:
            follow = self.follows[item.job_id]
            self.send(item.message(follow.url, follow.tenant))
        if out:
            log.info("enqueued %d webhook events", len(out))

    def _save(self, finished: list[str]) -> None:
        """Persist every follower's cursor (the entry before any tokens still held), drop finished jobs."""
        pipe = self.redis.pipeline(transaction=False)
        cursors = {}
        for job_id, follow in self.follows.items():
            if job_id in finished:
                continue
            batch = self.batches.holding(job_id)
            cursor = batch.resume_after if batch is not None else follow.handled
            if cursor is not None:
                cursors[job_id] = cursor
        if cursors:
            pipe.hset(self.keys.webhook_cursors(), mapping=cursors)
        pipe.execute()
        if finished:
            self._drop(finished)

    def _drop(self, job_ids: list[str]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.zrem(self.keys.webhook_jobs(), *job_ids)
        pipe.hdel(self.keys.webhook_cursors(), *job_ids)
        pipe.execute()
        for job_id in job_ids:
            self.follows.pop(job_id, None)
            self.batches.take(job_id)

    def _job_of(self, stream: Any) -> str:
        # {ns}:job:{id}:events
        return _text(stream).rsplit(":", 2)[1]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def send_delivery(celery: Any, message: dict[str, Any], queue: str) -> None:
    """Hand one delivery to the callbacks workers. Monitoring sees its event type, ids and attempt:
    never the receiver's URL nor the body (another tenant's output)."""
    from app.core.broker import send_redacted
    from app.webhooks.delivery import DELIVER_TASK

    summary = (
        f"<{message.get('type', 'event')} webhook {str(message.get('webhook_id', ''))[:8]}"
        f" job {str(message.get('job_id', ''))[:8]} attempt {message.get('attempt', 1)}>"
    )
    send_redacted(celery, DELIVER_TASK, message, queue=queue, summary=summary)


def run_dispatcher(settings: Settings) -> None:
    """Entry point of `conveyor webhooks dispatcher`."""
    import signal

    from app.core import metrics
    from app.core.broker import create_celery_app
    from app.core.redis import sync_client

    url = settings.redis_url or ""
    keys = Keys(settings.namespace)
    celery = create_celery_app(settings, url)
    queue = keys.callbacks_queue()

    def send(message: dict[str, Any]) -> None:
        send_delivery(celery, message, queue)

    metrics.serve(settings.metrics_port, "webhooks dispatcher", settings.api_host)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    log.info("webhook dispatcher following %s", keys.webhook_jobs())
    Dispatcher(sync_client(url), keys, settings.webhook, send, job_ttl_s=settings.job_ttl_s).run(stop)
