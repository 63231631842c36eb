"""The Celery app factory and the senders: what crosses the broker, and what monitoring sees of it.

Every process that sends work builds its app here (the API, the batcher, the webhook dispatcher,
the workers); only workers serve (`app.workers.celery_app`). A message's arguments are job data:
prompt token ids, hidden states, webhook URLs and bodies. Celery renders a task's arguments as text
into its events and logs (`argsrepr`), which Flower shows to whoever can open it, so every sender
here replaces that text with a summary that names the work and carries none of its data.
"""

from __future__ import annotations

from typing import Any

from celery import Celery

from app.core.config import Settings
from app.core.protocol import EMBED_TASK, STEP_TASK, StepMessage, broker_priority

VISIBILITY_TIMEOUT_S = 3600
PRIORITY_STEPS = (0, 3, 6, 9)


def create_celery_app(settings: Settings, broker_url: str) -> Celery:
    app = Celery("conveyor", broker=broker_url, set_as_current=False)
    transport = {
        "visibility_timeout": VISIBILITY_TIMEOUT_S,
        # A queue is one Redis list per priority step, BRPOPed in step order: 0 is fetched first.
        # Urgent prefills go at 0, normal at 3, batch at 6 (app.core.protocol.broker_priority); the
        # lists are `<queue>`, `<queue>:3`, `<queue>:6`, `<queue>:9` (what an autoscaler counts).
        "priority_steps": list(PRIORITY_STEPS),
        "sep": ":",
    }
    app.conf.update(
        # msgpack carries tensor bytes as they are; json is what Flower's control commands use.
        # pickle is refused, so a broker cannot run code in a worker.
        task_serializer="msgpack",
        accept_content=["msgpack", "json"],
        result_serializer="msgpack",
        task_ignore_result=True,
        # A step is acknowledged after it ran, and a step whose worker died goes back to the queue.
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        broker_transport_options=transport,
        visibility_timeout=VISIBILITY_TIMEOUT_S,
        broker_connection_retry_on_startup=True,
        worker_send_task_events=settings.flower,
        task_send_sent_event=False,
        worker_hijack_root_logger=False,
        worker_redirect_stdouts=False,
        task_default_queue=f"{settings.namespace}.default",
    )
    return app


def send_redacted(
    app: Celery,
    task: str,
    payload: dict[str, Any],
    *,
    queue: str,
    summary: str,
    priority: int | None = None,
) -> None:
    """Send `task` with `payload` as its one argument; monitoring sees `summary` instead of it."""
    options: dict[str, Any] = {"queue": queue, "argsrepr": summary, "kwargsrepr": "{}"}
    if priority is not None:
        options["priority"] = priority
    app.send_task(task, args=[payload], **options)


def send_step(app: Celery, message: StepMessage, queue: str) -> None:
    """Send a stage message at its broker priority, shown in monitoring by its summary only."""
    send_redacted(
        app,
        STEP_TASK,
        message.to_wire(),
        queue=queue,
        summary=message.summary(),
        priority=broker_priority(message),
    )


def send_embedding(app: Celery, message: dict[str, Any], queue: str) -> None:
    """Send a batch of embeddings jobs to an embeddings stage (their token ids or hidden states
    travel in it), shown in monitoring by its summary only."""
    stage = "tensors" if message.get("tensors") else "input"
    summary = f"<embed {stage} batch {str(message['batch_id'])[:8]} {len(message['job_ids'])} jobs>"
    send_redacted(app, EMBED_TASK, message, queue=queue, summary=summary)
