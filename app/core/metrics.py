"""Prometheus metrics: one set of names for every process, each process exporting what it sees.

The api serves `/metrics` on its own port; the batcher, the stage workers and the webhook processes
serve theirs on `CONVEYOR_METRICS_PORT` (one port per process; `conveyor up` numbers them upwards
from it). Who observes what:

- api: HTTP requests and their latency, admission refusals, cancellations, routing choices, and,
  read from Redis at each scrape, the intake depth per class, live workers per stage and each breaker's state;
- batcher: intake wait per class, batch size and padding, jobs that expired or were lost, and each
  pipeline's live replicas and in-flight budget;
- stage workers: partition latency per step, their heartbeat, device memory (NVML on a GPU, the
  process's resident memory on the CPU), whether they are unhealthy and why; the last stage also
  time to first token, inter-token latency, end-to-end latency, tokens generated and how jobs ended.

Names follow Prometheus' conventions: the `conveyor_` prefix, base units, `_total` on counters.
`deploy/prometheus/rules.yml` and the Grafana dashboard use exactly these names.
"""

from __future__ import annotations

import logging
import resource
import sys
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)

log = logging.getLogger(__name__)

CONTENT_TYPE = CONTENT_TYPE_LATEST
# Seconds: from a fast decode step to a long generation under load.
LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    0.8,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
RATIO_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0)
BREAKER_STATES = {"closed": 0, "half_open": 1, "open": 2}

# ---------------------------------------------------------------- api
HTTP_REQUESTS = Counter(
    "conveyor_http_requests",
    "HTTP requests answered, by route template and status",
    ["route", "method", "status"],
)
HTTP_DURATION = Histogram(
    "conveyor_http_request_duration_seconds",
    "Time to answer an HTTP request (a stream: until it ends)",
    ["route", "method"],
    buckets=LATENCY_BUCKETS,
)
ADMISSION_REFUSED = Counter(
    "conveyor_admission_refused", "Submits refused by admission control, by reason", ["reason"]
)
INTAKE_DEPTH = Gauge("conveyor_intake_depth", "Jobs waiting in the intake, by class", ["model", "priority"])
WORKERS_LIVE = Gauge("conveyor_workers_live", "Stage workers with a fresh heartbeat", ["model", "stage"])
BREAKER_STATE = Gauge("conveyor_breaker_state", "Circuit breaker: 0 closed, 1 half-open, 2 open", ["model"])
ROUTES = Counter(
    "conveyor_routes",
    "Jobs queued through a route (model auto, or one in CONVEYOR_ROUTES): the model it chose, and why",
    ["route", "model", "reason"],
)
ANONYMOUS_REQUESTS = Counter(
    "conveyor_anonymous_requests",
    "Requests served without authentication, as tenant anonymous (CONVEYOR_AUTH=none)",
)
STREAMS_REFUSED = Counter(
    "conveyor_streams_refused",
    "Event streams refused because their tenant had CONVEYOR_TENANT_MAX_STREAMS open (429)",
)

# ---------------------------------------------------------------- batcher
INTAKE_WAIT = Histogram(
    "conveyor_intake_wait_seconds",
    "Time a job waited in the intake before its batch was dispatched",
    ["model", "priority"],
    buckets=LATENCY_BUCKETS,
)
BATCH_SIZE = Histogram("conveyor_batch_size", "Jobs per dispatched batch", ["model"], buckets=BATCH_BUCKETS)
BATCH_PADDING = Histogram(
    "conveyor_batch_padding_ratio",
    "Share of a dispatched batch's prompt positions that are padding",
    ["model"],
    buckets=RATIO_BUCKETS,
)
PIPELINE_REPLICAS = Gauge(
    "conveyor_pipeline_replicas",
    "Live replicas of the model's thinnest stage, at least 1: what its in-flight budget is scaled by",
    ["model"],
)
INFLIGHT_BUDGET = Gauge(
    "conveyor_inflight_budget",
    "Work the batcher lets a model's pipeline hold now, in batches or sequences",
    ["model", "unit"],
)

# ---------------------------------------------------------------- stage workers
PARTITION_LATENCY = Histogram(
    "conveyor_partition_latency_seconds",
    "Model compute of one step (prefill or decode) on one partition",
    ["model", "partition_id"],
    buckets=STEP_BUCKETS,
)
PREFIX_TOKENS = Counter(
    "conveyor_prefix_cache_tokens",
    "Prompt tokens a stage prefilled, by where their keys and values came from (cache or computed)",
    ["model", "stage", "source"],
)
PREFIX_CACHE_BYTES = Gauge(
    "conveyor_prefix_cache_bytes", "Memory a stage's prefix cache holds", ["model", "stage"]
)
HEARTBEAT = Gauge(
    "conveyor_worker_heartbeat_timestamp_seconds",
    "When this worker last wrote its heartbeat to Redis",
    ["model", "stage", "worker"],
)
DEVICE_MEMORY_USED = Gauge("conveyor_device_memory_used_bytes", "Device memory in use", ["device"])
DEVICE_MEMORY_TOTAL = Gauge("conveyor_device_memory_total_bytes", "Device memory in all", ["device"])
DEVICE_UTILIZATION = Gauge(
    "conveyor_device_utilization_ratio", "Device compute utilisation, 0..1", ["device"]
)
DEVICE_TEMPERATURE = Gauge("conveyor_device_temperature_celsius", "Device temperature", ["device"])
STAGE_UNHEALTHY = Gauge(
    "conveyor_stage_unhealthy",
    "1 while this stage replica takes no new batches: a report crossed the health threshold `reason`",
    ["model", "stage", "worker", "reason"],
)
TTFT = Histogram(
    "conveyor_time_to_first_token_seconds",
    "From submit to the first token written to the job's stream",
    ["model", "priority"],
    buckets=LATENCY_BUCKETS,
)
INTER_TOKEN = Histogram(
    "conveyor_inter_token_latency_seconds",
    "Between two tokens of one job",
    ["model"],
    buckets=STEP_BUCKETS,
)
JOB_LATENCY = Histogram(
    "conveyor_job_latency_seconds",
    "From submit to the job's end (succeeded)",
    ["model", "priority"],
    buckets=LATENCY_BUCKETS,
)
TOKENS = Counter("conveyor_tokens_generated", "Tokens generated", ["model"])
JOBS = Counter("conveyor_jobs", "Jobs that ended, by status and reason", ["model", "status", "reason"])


def job_ended(model: str, status: str, reason: str, count: int = 1) -> None:
    if count:
        JOBS.labels(model=model, status=status, reason=reason).inc(count)


def device_observed(device: str, stats: dict[str, Any] | None) -> None:
    """A GPU's stats from NVML or torch (app.workers.device), or the process's memory on the CPU."""
    if stats is None:
        DEVICE_MEMORY_USED.labels(device="cpu").set(resident_bytes())
        return
    if "memory_used_mib" in stats:
        DEVICE_MEMORY_USED.labels(device=device).set(stats["memory_used_mib"] * 2**20)
        DEVICE_MEMORY_TOTAL.labels(device=device).set(stats["memory_total_mib"] * 2**20)
    if "utilization_pct" in stats:
        DEVICE_UTILIZATION.labels(device=device).set(stats["utilization_pct"] / 100.0)
    if "temperature_c" in stats:
        DEVICE_TEMPERATURE.labels(device=device).set(stats["temperature_c"])


def resident_bytes() -> int:
    """This process's resident memory: /proc on Linux, the peak from getrusage elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def exposition() -> bytes:
    """This process's metrics in the text format (what `/metrics` answers)."""
    return generate_latest()


def serve(port: int | None, process: str, host: str = "127.0.0.1") -> None:
    """Serve this process's `/metrics` on `host:port` (port None or 0: not at all). A port already
    taken is logged, not fatal: metrics must never keep a worker from serving."""
    if not port:
        return
    try:
        start_http_server(port, addr=host)
    except OSError as exc:
        log.warning("%s: metrics not served, port %d: %s", process, port, exc)
        return
    log.info("%s: metrics on :%d/metrics", process, port)
