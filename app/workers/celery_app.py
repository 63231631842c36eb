"""The Celery app factory. The app is always passed explicitly; nothing here runs at import."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from celery import Celery

from app.core.config import Settings
from app.core.keys import Keys
from app.core.protocol import STEP_TASK

if TYPE_CHECKING:
    from app.workers.lane import LaneConsumer

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
        worker_send_task_events=settings.celery_events,
        task_send_sent_event=False,
        worker_hijack_root_logger=False,
        worker_redirect_stdouts=False,
        task_default_queue=f"{settings.namespace}.default",
    )
    return app


def register_step_task(app: Celery, handle: Callable[[dict[str, Any]], None]) -> None:
    """The stage task is a thin adapter: decode nothing, decide nothing, hand the message on."""

    @app.task(name=STEP_TASK, ignore_result=True)
    def step(message: dict[str, Any]) -> None:
        handle(message)


def serve(
    app: Celery,
    settings: Settings,
    *,
    redis: Any,
    heartbeat_key: str,
    worker: str,
    hostname: str,
    queues: list[str],
    lane: LaneConsumer | None = None,
    device: str = "cpu",
    loglevel: str = "INFO",
    labels: tuple[str, str] = ("", ""),
    slots: int = 1,
    info: dict[str, Any] | None = None,
) -> None:
    """Run a worker on `queues` (one process owns one partition), beating its heartbeat.

    Called by the stage and embeddings worker entry points once their model is loaded. A stage
    worker also consumes its `lane` on a thread of its own for as long as the Celery worker runs.
    `slots` > 1 runs tasks on that many threads (the caller serialises the model's work): a message
    is then fetched while another waits its turn, so an urgent prefill can go before a normal one
    that arrived first. With 1, the solo pool runs each task in the consumer's own thread.
    """
    import logging

    from app.core import metrics
    from app.workers.heartbeat import Heartbeat

    metrics.serve(settings.metrics_port, hostname, settings.metrics_host)

    # One line per step would drown the log; Flower and the metrics show the tasks.
    for name in ("celery.app.trace", "celery.worker.strategy"):
        logging.getLogger(name).setLevel(logging.WARNING)
    heartbeat = Heartbeat(
        redis,
        heartbeat_key,
        worker,
        interval_s=settings.heartbeat_interval_s,
        ttl_s=settings.heartbeat_ttl_s,
        devices_key=Keys(settings.namespace).devices(),
        device=device,
        labels=labels,
        info_key=Keys(settings.namespace).stage_info() if info is not None else None,
        info=info,
    )
    heartbeat.beat()
    heartbeat.start()
    if lane is not None:
        lane.start()
    try:
        app.worker_main(
            [
                "worker",
                "--pool=threads" if slots > 1 else "--pool=solo",
                f"--concurrency={slots}",
                f"--loglevel={loglevel}",
                f"--hostname={hostname}@%h",
                "--queues",
                ",".join(queues),
                "--without-mingle",
                "--without-gossip",
                *(["--events"] if settings.celery_events else []),
            ]
        )
    finally:
        if lane is not None:
            lane.stop()
        heartbeat.stop()
