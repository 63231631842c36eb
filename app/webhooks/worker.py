"""The callbacks worker: a Celery worker on the callbacks queue, a thread pool (deliveries wait on
the network, not the CPU). The task is a thin adapter over `Deliverer.deliver`, which schedules a
retry in Redis (the dispatcher sends it back when due; no ETA task waits in this worker's memory),
and is safe to run twice (an event's id settles once)."""

from __future__ import annotations

import logging
import os
from typing import Any

from celery import Celery

from app.core.config import Settings
from app.core.keys import Keys
from app.webhooks.delivery import DELIVER_TASK, Deliverer
from app.webhooks.signing import TenantSecrets
from app.webhooks.ssrf import Guard

log = logging.getLogger(__name__)


def register_deliver_task(app: Celery, deliverer: Deliverer) -> None:
    @app.task(name=DELIVER_TASK, ignore_result=True)
    def deliver(message: dict[str, Any]) -> None:
        deliverer.deliver(message)


def run_callbacks_worker(settings: Settings, *, loglevel: str = "INFO") -> None:
    """Entry point of `conveyor webhooks worker`."""
    from app.core import metrics
    from app.core.broker import create_celery_app
    from app.core.known_secrets import refuse_known_secrets
    from app.core.redis import sync_client

    refuse_known_secrets(settings)
    if settings.auth != "none" and not settings.webhook.master_key:
        raise SystemExit(
            "no webhook master key: with API keys or JWTs every tenant's deliveries are signed with its own "
            "secret, derived from CONVEYOR_WEBHOOK_MASTER_KEY (whsec_...; `conveyor up` makes one)"
        )
    url = settings.redis_url or ""
    keys = Keys(settings.namespace)
    hooks = settings.webhook
    redis = sync_client(url)
    secrets = TenantSecrets(  # a malformed secret stops the worker here, loudly
        hooks.secrets,
        master=hooks.master_key,
        redis=redis,
        keys=keys,
    )
    if not secrets.default:
        raise SystemExit("no webhook secret: set CONVEYOR_WEBHOOK_SECRETS (`conveyor up` makes one)")
    app = create_celery_app(settings, url)
    guard = Guard(hooks.allow_cidrs)
    register_deliver_task(
        app,
        Deliverer(redis, keys, settings.webhook, guard=guard, secrets=secrets, job_ttl_s=settings.job_ttl_s),
    )
    for name in ("celery.app.trace", "celery.worker.strategy", "httpx"):  # each attempt is logged in Redis
        logging.getLogger(name).setLevel(logging.WARNING)
    metrics.serve(settings.metrics_port, "callbacks worker", settings.api_host)
    log.info("callbacks worker on %s, %d threads", keys.callbacks_queue(), hooks.concurrency)
    app.worker_main(
        [
            "worker",
            "--pool=threads",
            f"--concurrency={hooks.concurrency}",
            f"--loglevel={loglevel}",
            f"--hostname=callbacks-{os.getpid()}@%h",
            "--queues",
            keys.callbacks_queue(),
            "--without-mingle",
            "--without-gossip",
            *(["--events"] if settings.flower else []),
        ]
    )
