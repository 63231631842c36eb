"""The callbacks worker: a Celery worker on the callbacks queue, a thread pool (deliveries wait on
the network, not the CPU). The task is a thin adapter over `Deliverer.attempt`: it retries itself
after the delay the attempt returns (an ETA message; the delay stays under the broker's visibility
timeout, see `webhook_backoff_max_s`), and is safe to run twice (an event's id settles once)."""

from __future__ import annotations

import logging
import os
from typing import Any

from celery import Celery

from app.core.config import Settings
from app.core.keys import Keys
from app.webhooks.delivery import DELIVER_TASK, Deliverer
from app.webhooks.signing import SecretBook
from app.webhooks.ssrf import Guard

log = logging.getLogger(__name__)


def register_deliver_task(app: Celery, deliverer: Deliverer) -> None:
    @app.task(name=DELIVER_TASK, bind=True, ignore_result=True, max_retries=None)
    def deliver(self: Any, message: dict[str, Any]) -> None:
        delay = deliverer.attempt(message, self.request.retries + 1)
        if delay is not None:
            raise self.retry(countdown=delay)


def run_callbacks_worker(settings: Settings, *, loglevel: str = "INFO") -> None:
    """Entry point of `conveyor webhooks worker`."""
    from app.core import metrics
    from app.core.redis import sync_client
    from app.workers.celery_app import create_celery_app

    secrets = SecretBook(settings.webhook_secrets)  # a malformed secret stops the worker here, loudly
    if not secrets.default:
        raise SystemExit("no webhook secret: set CONVEYOR_WEBHOOK_SECRETS (`conveyor up` makes one)")
    url = settings.redis_url or ""
    keys = Keys(settings.namespace)
    app = create_celery_app(settings, url)
    guard = Guard(settings.webhook_allow_cidrs)
    register_deliver_task(app, Deliverer(sync_client(url), keys, settings, guard=guard, secrets=secrets))
    for name in ("celery.app.trace", "celery.worker.strategy", "httpx"):  # each attempt is logged in Redis
        logging.getLogger(name).setLevel(logging.WARNING)
    metrics.serve(settings.metrics_port, "callbacks worker", settings.metrics_host)
    log.info("callbacks worker on %s, %d threads", keys.callbacks_queue(), settings.webhook_concurrency)
    app.worker_main(
        [
            "worker",
            "--pool=threads",
            f"--concurrency={settings.webhook_concurrency}",
            f"--loglevel={loglevel}",
            f"--hostname=callbacks-{os.getpid()}@%h",
            "--queues",
            keys.callbacks_queue(),
            "--without-mingle",
            "--without-gossip",
            *(["--events"] if settings.celery_events else []),
        ]
    )
