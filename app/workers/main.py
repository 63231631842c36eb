"""Entry point of a stage worker process: load the partition, then serve its stage queue and its lane."""

from __future__ import annotations

import logging
import os
import socket
import uuid
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, GenerationConfig

from app.core import breaker, credit
from app.core.broker import VISIBILITY_TIMEOUT_S, create_celery_app, send_step
from app.core.config import Settings
from app.core.cpus import allowed, format_cpus
from app.core.errors import ModelNotFound, UnsupportedModel
from app.core.health import Thresholds
from app.core.jobstore import JobStore
from app.core.keys import Keys
from app.core.modelstore import registered_dtype
from app.core.outcomes import Outcomes
from app.core.protocol import StepMessage
from app.core.redis import sync_client
from app.partitions import ragged
from app.partitions.claimcheck import ClaimCheck
from app.partitions.layers import LayerRange, StagePartition
from app.partitions.loading import check_servable
from app.partitions.precision import dtype_name, resolve_dtype
from app.partitions.prefix import PrefixCache
from app.workers import lane
from app.workers.celery_app import register_step_task, serve
from app.workers.compute import ComputeThread
from app.workers.device import bound_kernel_caches
from app.workers.engine.runtime import EngineRuntime, Pump, scheduler_config
from app.workers.health import HealthMonitor, gated
from app.workers.latency import StepLatency
from app.workers.stage import Send, StageIdentity, StageRuntime
from app.workers.threads import elastic, fixed

# Stage tensors of at least this many bytes go through Redis by reference (claim check): inline,
# kombu's JSON + base64 costs CPU at both ends. The measured break-even is 18 to 37 KB
# (bench/results/hop.md: an 8x128x576 prefill takes 52.5 ms inline, 4.1 ms by claim check).
CLAIM_CHECK_BYTES = 32 * 1024

log = logging.getLogger(__name__)


def eos_token_ids(path: str, config: object) -> frozenset[int]:
    ids: set[int] = set()
    for source in (config, _generation_config(path)):
        value = getattr(source, "eos_token_id", None)
        if value is not None:
            ids.update(value if isinstance(value, list) else [value])
    return frozenset(ids)


def _generation_config(path: str) -> GenerationConfig | None:
    try:
        return GenerationConfig.from_pretrained(path)
    except OSError:
        return None


def run_worker(
    settings: Settings,
    *,
    model: str,
    stage: int,
    num_stages: int,
    share: int | None = None,
    loglevel: str = "INFO",
) -> None:
    """Serve stage `stage` of `model`'s pipeline until stopped. `share`: the torch threads this
    worker keeps while other processes use the host (`conveyor up` passes its share of the cores)."""
    path = settings.model_path(model)
    if path is None:
        raise ModelNotFound(f"model {model!r} is not available; run `conveyor model pull`", model=model)
    keys = Keys(settings.namespace)
    worker = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    identity = StageIdentity(
        model=model,
        stage=stage,
        num_stages=num_stages,
        worker=worker,
        shared_queue=keys.stage_queue(model, stage),
        lane=keys.lane(model, stage, worker),
        next_queue=keys.stage_queue(model, stage + 1) if stage + 1 < num_stages else None,
        first_queue=keys.stage_queue(model, 0),
    )

    # Weights load here, at worker start, never at import: this stage's tensors only, on the
    # thread that will run them (see app.workers.compute).
    check_servable(path)  # a model the stages cannot serve is refused here, before any weight is read
    layers = stage_layers(settings, path, stage=stage, num_stages=num_stages)
    device = resolve_device(settings.device, stage)
    # a count that is set stays; else this worker's share (every CPU but one alone), widened while
    # the host's other CPUs are idle. Everything on the compute thread, load and warm-up first, runs on it.
    threads = fixed(settings.torch_threads) if settings.torch_threads else elastic(share)
    compute = ComputeThread(threads=threads)
    compute.start()

    def load() -> tuple[StagePartition, torch.dtype]:
        bound_kernel_caches()  # before the warm-up runs the first kernel
        chosen = registered_dtype(path)  # `model add --dtype`; else the setting
        dtype = resolve_dtype(chosen if chosen not in (None, "auto") else settings.dtype, device)
        return load_partition(path, layers, device, dtype, settings.compile), dtype

    partition, dtype = compute.call(load)
    # the last stage samples; stage 0 of the step engine reads each job's request as it admits it
    step_engine = engine_of(settings, num_stages, partition) == "step"
    reads = partition.is_last or (partition.is_first and step_engine)
    tokenizer = AutoTokenizer.from_pretrained(path) if reads else None
    info = served_info(settings, model, stage, layers, partition, dtype, device, num_stages)
    log.info(
        "stage %d/%d of %s (%s): layers %d-%d on %s in %s, %.1f MiB of parameters, %s CPU threads "
        "on CPUs %s, decode steps %s, prefix cache %d MiB, engine %s",
        stage,
        num_stages,
        model,
        partition.family.name,
        layers.start,
        layers.stop - 1,
        device,
        dtype_name(dtype),
        partition.param_bytes() / 2**20,
        threads.describe(),
        format_cpus(allowed()),
        info["decode_steps"],
        settings.prefix_cache_mb,
        info["engine"],
    )

    redis_url = settings.redis_url or ""
    redis = sync_client(redis_url)
    celery = create_celery_app(settings, redis_url)

    def send(message: StepMessage, queue: str) -> None:
        send_step(celery, message, queue)

    runtime = stage_runtime(
        settings,
        identity,
        partition,
        tokenizer,
        path=path,
        layers=layers,
        redis=redis,
        send=send,
        hand_off=lambda message, key: lane.send(redis, key, message.to_wire()),
    )

    # On the step engine a message admits jobs, runs a step on a later stage or brings a step's
    # tokens back to stage 0: each runs between two of stage 0's steps, in arrival order.
    engine = isinstance(runtime, EngineRuntime)
    if isinstance(runtime, EngineRuntime) and partition.is_first:
        Pump(runtime, compute).start()

    def handle(wire: dict[str, object]) -> None:
        message = StepMessage.from_wire(wire)
        urgent = message.urgent or engine
        compute.call(
            lambda: runtime.run(message), urgent=urgent, background=message.background and not engine
        )

    health = HealthMonitor(
        redis,
        keys,
        model=model,
        stage=stage,
        worker=worker,
        queue=identity.shared_queue,
        thresholds=Thresholds.from_settings(settings),
    )

    # Prefills fetched just before this replica turned unhealthy go back to the stage's queue.
    requeue = lambda wire: send(StepMessage.from_wire(wire), identity.shared_queue)  # noqa: E731
    register_step_task(celery, gated(health, handle, requeue))

    serve(
        celery,
        settings,
        redis=redis,
        heartbeat_key=keys.workers(model, stage),
        worker=worker,
        hostname=f"stage{stage}-{model}-{worker}",
        queues=[identity.shared_queue],
        lane=lane.LaneConsumer(redis, identity.lane, handle),
        device=device,
        loglevel=loglevel,
        labels=(model, str(stage)),
        # Task threads and the lane thread queue their messages for the compute thread (urgent
        # first). Four task threads hold four prefills; further ones wait in the stage queue, where
        # the autoscaler counts them (the batcher keeps REPLICA_BATCHES, app/batching/budget.py, in
        # flight per live replica). An urgent prefill waiting there is the next one fetched, as soon
        # as a thread is free.
        slots=4,
        info=info,
        health=health,
    )
    if isinstance(runtime, EngineRuntime) and isinstance(runtime.advertise, credit.Advertiser):
        try:
            runtime.advertise.withdraw()
        except Exception:  # Redis away: the batcher stops counting it with its heartbeat anyway
            log.debug("could not withdraw the credit", exc_info=True)
    compute.stop()


def served_info(
    settings: Settings,
    model: str,
    stage: int,
    layers: LayerRange,
    partition: StagePartition,
    dtype: torch.dtype,
    device: str,
    num_stages: int | None = None,
) -> dict[str, Any]:
    """What a stage worker of a pipeline of `num_stages` stages (the setting's unless given) says it
    serves, with each heartbeat (shown by /readyz to admins)."""
    return {
        "model": model,
        "stage": stage,
        "layers": [layers.start, layers.stop],
        "family": partition.family.name,
        "dtype": dtype_name(dtype),
        "device": device,
        "decode_steps": "graphs"
        if partition.static is not None and partition.static.refused is None
        else "eager",
        "param_bytes": partition.param_bytes(),
        "prefix_cache_mb": settings.prefix_cache_mb,
        "engine": engine_of(settings, num_stages or settings.stages, partition),
    }


def stage_runtime(
    settings: Settings,
    identity: StageIdentity,
    partition: StagePartition,
    tokenizer: Any,
    *,
    path: Path,
    layers: LayerRange,
    redis: Any,
    send: Send,
    hand_off: Send,
) -> StageRuntime:
    """The runtime of one stage replica as `settings` configure it; messages leave through `send`
    (a stage's shared queue) and `hand_off` (a replica's lane). The in-process test stack builds
    its stages here too."""
    keys = Keys(settings.namespace)
    jobs = JobStore(redis, keys, ttl_s=settings.job_ttl_s)
    engine: dict[str, Any] = {}
    kind: type[StageRuntime] = StageRuntime
    if engine_of(settings, identity.num_stages, partition) == "step":
        kind = EngineRuntime
        engine["heartbeat_ttl_s"] = settings.heartbeat_ttl_s
        if partition.is_first:  # stage 0 plans every step of its pipeline replica
            engine["engine"] = scheduler_config(
                kv_positions=settings.max_batch_kv_positions,
                max_running=settings.max_running_sequences,
                step_tokens=settings.max_prefill_tokens,
                caching=settings.prefix_cache_mb > 0,
                depth=identity.num_stages,  # a plan in flight per stage
            )
            # It advertises what it may still take: the batcher sends against that (app/core/credit.py).
            engine["advertise"] = credit.Advertiser(
                redis, keys, identity.model, identity.worker, ttl_s=settings.heartbeat_ttl_s
            )
    return kind(
        identity=identity,
        partition=partition,
        tokenizer=tokenizer,
        jobs=jobs,
        outcomes=Outcomes(
            redis,
            keys,
            jobs,
            life=settings.lifetimes,
            breaker=breaker.recorder(redis, keys, identity.model),  # the breaker counts what ends here
        ),
        redis=redis,
        keys=keys,
        send=send,
        hand_off=hand_off,
        eos_ids=eos_token_ids(str(path), partition.config),
        pad_id=_pad_id(partition.config),
        max_running=settings.max_running_sequences,
        max_kv_positions=settings.max_batch_kv_positions,
        latency=StepLatency(
            redis, keys, identity.model, identity.stage, (layers.start, layers.stop), identity.worker
        ),
        stale_after_s=4 * settings.stall_timeout_s,
        prefixes=PrefixCache(settings.prefix_cache_mb * 2**20) if settings.prefix_cache_mb else None,
        claims=ClaimCheck(redis, settings.namespace, CLAIM_CHECK_BYTES, VISIBILITY_TIMEOUT_S),
        **engine,
    )


def engine_of(settings: Settings, num_stages: int, partition: StagePartition) -> str:
    """The engine a stage of a pipeline of `num_stages` runs: the setting's, and for `auto` the step
    engine where it serves the pipeline (on a CPU, a model ragged steps run exactly)."""
    if settings.engine != "auto":
        return settings.engine
    if partition.device.type != "cpu":
        return "batch"
    try:
        ragged.check(partition)
    except UnsupportedModel:
        return "batch"
    return "step"


def load_partition(
    path: Path, layers: LayerRange, device: str, dtype: torch.dtype, compile_setting: str = "off"
) -> StagePartition:
    """Load and warm up one stage's layers (on the compute thread, which runs them from then on).
    The warm-up's decode step is the first captured one where `compile_setting` asks for CUDA
    graphs: a stage whose steps cannot be captured turns to eager steps here, with a warning."""
    partition = StagePartition.load(path, layers, dtype=dtype, device=device)
    partition.use_static(compile_setting)
    partition.warmup()
    return partition


def stage_layers(settings: Settings, path: Path, *, stage: int, num_stages: int) -> LayerRange:
    """This stage's layers: from the plan file when one is given, else cut where each stage computes
    as evenly as can be (`conveyor plan --stages N`'s cut: the embedding, the layers and the norm and
    head counted by their FLOPs; an even count of layers leaves the head's stage the slowest)."""
    from app.partitions.planner import Plan, load_config, plan_decoder

    if settings.plan_file is not None:
        ranges = Plan.from_json(Path(settings.plan_file).read_text()).ranges()
        if len(ranges) != num_stages:
            raise ValueError(f"plan {settings.plan_file} has {len(ranges)} stages, the pipeline {num_stages}")
        return LayerRange(*ranges[stage])
    if num_stages == 1:
        return LayerRange(0, int(load_config(path).num_hidden_layers))
    return LayerRange(*plan_decoder(load_config(path), stages=num_stages).ranges()[stage])


def resolve_device(setting: str, stage: int) -> str:
    """`auto`: stage k on GPU k modulo the GPUs present, the CPU when there is none."""
    if setting != "auto":
        return setting
    if torch.cuda.is_available():
        return f"cuda:{stage % torch.cuda.device_count()}"
    return "cpu"


def _pad_id(config: object) -> int:
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(config, name, None)
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0
