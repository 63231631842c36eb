"""The worker side of Celery: the stage task and the worker loop. The app factory and the senders
live in `app.core.broker` (every layer sends; only workers serve)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from celery import Celery

from app.core.config import Settings
from app.core.keys import Keys
from app.core.protocol import STEP_TASK

if TYPE_CHECKING:
    from app.workers.health import HealthMonitor
    from app.workers.lane import LaneConsumer


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
    health: HealthMonitor | None = None,
    device_stats: Callable[[str], dict[str, Any] | None] | None = None,
) -> None:
    """Run a worker on `queues` (one process owns one partition), beating its heartbeat.

    Called by the stage and embeddings worker entry points once their model is loaded. A stage
    worker also consumes its `lane` on a thread of its own for as long as the Celery worker runs.
    `slots` > 1 runs tasks on that many threads (the caller serialises the model's work): a message
    is then fetched while another waits its turn, so an urgent prefill can go before a normal one
    that arrived first. With 1, the solo pool runs each task in the consumer's own thread.
    `health` (stage workers) judges each heartbeat's report; the stage task's handler keeps new
    batches away from the replica while it is unhealthy (app/workers/health.py).
    """
    import logging

    from app.core import metrics
    from app.workers.device import device_stats as measured
    from app.workers.heartbeat import Heartbeat

    metrics.serve(settings.metrics_port, hostname, settings.api_host)

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
        observe=health.observe if health is not None else None,
        stats=device_stats or measured,  # the device's state; a test reports a device it has not got
    )
    if health is not None:  # a warm shutdown must not wait for threads holding handed-on messages
        from celery.signals import worker_shutting_down

        worker_shutting_down.connect(lambda **_: health.stop(), weak=False)
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
                *(["--events"] if settings.flower else []),
            ]
        )
    finally:
        if lane is not None:
            lane.stop()
        heartbeat.stop()
        if health is not None:
            try:
                health.withdraw()
            except Exception:  # Redis away at shutdown: the record expires on its own
                logging.getLogger(__name__).debug("could not withdraw the health record", exc_info=True)
