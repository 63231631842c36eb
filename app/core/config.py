"""The one place that reads the environment.

Every process builds a `Settings` at start-up (never at import) and passes it down explicitly.
Each field is a tunable with a default and a reason, written as a comment above or beside it:
docs/configuration.md is generated from those comments (`conveyor docs config`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from app.core.breaker import Policy as BreakerPolicy
from app.core.cpus import parse_cpus
from app.core.jobstore import Lifetimes
from app.core.keys import PRIORITIES, PRIORITY_ALIASES

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
EMBEDDING_MODEL = "all-MiniLM-L6-v2"  # /v1/embeddings' one model (app/workers/embedding.py)
# Its texts are truncated at this many tokens: sentence-transformers' max_seq_length for it
# (sentence_bert_config.json).
EMBEDDING_MAX_TOKENS = 256
# A model's name: a directory name under the model home and a Redis key part, never a path.
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def pipeline_stages(model: str, *, stages: int, embedding_stages: int) -> int:
    """How many stages `model`'s pipeline has: the embeddings model its own count, every generation
    model `stages`. One answer for the API's admission and the batcher's census and monitor."""
    return embedding_stages if model == EMBEDDING_MODEL else stages


def valid_model_name(name: str) -> bool:
    """Whether `name` can name a model: no separators, no `..`, no leading dot (hidden, partial)."""
    return MODEL_NAME.fullmatch(name) is not None and ".." not in name


def find_model(name: str, *, models: Mapping[str, Path], model_home: Path) -> Path | None:
    """Where the model called exactly `name` lives: an entry of `models` (CONVEYOR_MODELS), or a
    directory of that name with a config.json in the model home; None otherwise. A name that cannot
    name a model (a path, `..`, a trailing slash) is refused without touching the disk, and a
    directory must be listed under that exact name (no case folding, no aliases)."""
    if name in models:
        return Path(models[name])
    if not valid_model_name(name) or name not in _home_entries(model_home):
        return None
    candidate = model_home / name
    return candidate if (candidate / "config.json").is_file() else None


def known_models(*, models: Mapping[str, Path], model_home: Path) -> list[str]:
    """Every model a request may name: configured (`models`), and added (or pulled) into the model
    home."""
    names = set(models)
    names.update(
        name
        for name in _home_entries(model_home)
        if valid_model_name(name) and (model_home / name / "config.json").is_file()
    )
    return sorted(names)


def _home_entries(model_home: Path) -> list[str]:
    try:
        return os.listdir(model_home)
    except OSError:  # no model home yet
        return []


class TenantLimits(BaseModel):
    """One tenant's rate limits (`Settings.rate_limits`); a field left out keeps the default."""

    model_config = ConfigDict(extra="forbid")

    rps: float | None = Field(default=None, ge=0)
    burst: int | None = Field(default=None, ge=1)
    tokens_per_min: int | None = Field(default=None, ge=0)
    embedding_bytes_per_min: int | None = Field(default=None, ge=0)
    retained_bytes: int | None = Field(default=None, ge=0)  # Settings.tenant_retained_bytes


class RoutePolicy(BaseModel):
    """One route's small-model / large-model policy (`Settings.routes`; app/core/routing.py applies it).

    A request goes to `large` when its prompt is longer than `max_prompt_chars`, it asks for more than
    `max_tokens` tokens, or its complexity score is over `max_complexity`; else to `small`. A model left
    unset is picked among the served ones by parameter count (the fewest: small, the most: large)."""

    model_config = ConfigDict(extra="forbid")

    small: str | None = None
    large: str | None = None
    # About 500 tokens of English: a question with its context, not a document to read.
    max_prompt_chars: int = Field(default=2000, ge=0)
    max_tokens: int = Field(default=256, ge=0)  # a paragraph; longer answers are worth the larger model
    # The score is 0..1 (app/core/routing.py); 0.3 needs two reasoning markers, or one with code or maths.
    max_complexity: float = Field(default=0.3, ge=0.0, le=1.0)
    # A job without timeout_s is routed as if it had to start within this: past it the other model's
    # queue is tried (the chosen one's predicted wait is admission's, W = A / R).
    deadline_s: float = Field(default=30.0, gt=0.0)

    @model_validator(mode="after")
    def _two_models(self) -> RoutePolicy:
        if self.small is not None and self.small == self.large:
            raise ValueError(f"a route needs two different models; small and large are both {self.small!r}")
        return self


@dataclass(frozen=True)
class WebhookSettings:
    """The webhook components' part of the settings (app/webhooks/: the dispatcher, the callbacks
    worker, the API's callback intake), built once by `Settings.webhooks`: the `webhook_*` fields
    without their prefix (described there), values derived from them, and the job TTL they follow."""

    secrets: tuple[str, ...]
    master_key: str | None
    secret_overlap_s: float
    allow_cidrs: tuple[str, ...]
    timeout_s: float
    attempt_deadline_s: float
    tenant_concurrency: int
    tenant_max_retries: int
    max_attempts: int
    backoff_base_s: float
    backoff_max_s: float
    token_interval_s: float  # webhook_token_interval_ms
    concurrency: int
    log_max: int
    disabled_ttl_s: int
    job_ttl_s: int  # a job's deliveries live as long as it may; the dispatcher follows it no longer


@dataclass(frozen=True)
class BatcherSettings:
    """The batcher's part of the settings (app/batching/scheduler.py), built once by
    `Settings.batcher`: the fields it reads, by their names in `Settings` (described there), and
    what derives from them computed here."""

    namespace: str
    stages: int
    embedding_stages: int
    batcher_max_pending: int
    monitor_interval_s: float
    tenant_weights: Mapping[str, float]
    max_batch_size: int
    max_wait_s: float  # max_wait_ms
    length_buckets: tuple[int, ...]  # sorted
    aging_s: float
    max_prefill_tokens: int | None  # None under request-level batching (batching=request)
    min_batch_size: int
    max_running_sequences: int | None  # None under request-level batching
    replica_batches: int
    max_inflight_batches: int | None
    max_inflight_sequences: int | None
    stall_timeout_s: float
    max_attempts: int
    heartbeat_ttl_s: float
    life: Lifetimes  # of the jobs it publishes for (Lifetimes.of): job_ttl_s, ended_job_ttl_s, stream cap

    def stages_of(self, model: str) -> int:
        return pipeline_stages(model, stages=self.stages, embedding_stages=self.embedding_stages)


@dataclass(frozen=True)
class AdmissionLimits:
    """Admission's queue limits (app/core/admission.py, gates 3 and 4, and the write script that
    checks them again) and the Retry-After it answers when no completion rate is measured."""

    class_depth: int  # queue_depth_limit
    overall: int  # overload_limit
    retry_after_s: float


@dataclass(frozen=True)
class AdmissionSettings:
    """Admission's part of the settings (app/core/admission.py: the gates and the write), built once
    by `Settings.admission`: the fields it reads, by their names in `Settings` (described there), and
    what derives from them computed here: the stage-down grace, the queue limits, the circuit
    breaker's policy, each tenant's queue limit, the Idempotency-Key's TTL and the job lifetimes."""

    stages: int
    embedding_stages: int
    heartbeat_ttl_s: float
    stage_down_after_s: float  # unset: 2 x heartbeat_ttl_s
    limits: AdmissionLimits  # queue_depth_limit, overload_limit, retry_after_s
    breaker: BreakerPolicy  # breaker_error_threshold, breaker_min_requests, breaker_interval_s
    # Jobs of one tenant that may wait in one class: tenant_queue_share of queue_depth_limit, and
    # each of tenant_queue_shares' tenants its own share of it.
    tenant_queue_default: int
    tenant_queue_limits: Mapping[str, int]
    idempotency_ttl_s: int  # at most job_ttl_s, so the job outlives its key
    # Bytes of jobs one tenant may keep in Redis (tenant_retained_bytes, and rate_limits' per-tenant
    # retained_bytes); None: derived from Redis's maxmemory (`retained_quota`); 0: no quota.
    tenant_retained_default: int | None
    tenant_retained_limits: Mapping[str, int]
    submit_fsync_timeout_ms: int
    life: Lifetimes  # of the jobs it writes (Lifetimes.of)

    def stages_of(self, model: str) -> int:
        return pipeline_stages(model, stages=self.stages, embedding_stages=self.embedding_stages)

    def tenant_queue_limit(self, tenant: str) -> int:
        """Jobs of `tenant` that may wait in one priority class: its share of queue_depth_limit,
        rounded down, at least one."""
        return self.tenant_queue_limits.get(tenant, self.tenant_queue_default)

    def retained_quota(self, tenant: str, maxmemory: int) -> int:
        """Bytes of jobs `tenant` may keep in Redis (0: no quota). Unset: a quarter of Redis's
        `maxmemory` (none without one): one tenant cannot take the store, and the high-water mark
        (admission's gate 0) bounds all of them together."""
        quota = self.tenant_retained_limits.get(tenant, self.tenant_retained_default)
        return maxmemory // RETAINED_SHARE_OF_MAXMEMORY if quota is None else quota


RETAINED_SHARE_OF_MAXMEMORY = 4  # a tenant's default retained-bytes quota: maxmemory / this


def queue_share(share: float, depth: int) -> int:
    """`share` of a class's `depth` jobs, rounded down, at least one."""
    return max(1, int(share * depth + 1e-9))  # 0.29 x 100 is 28.999... in floats


@dataclass(frozen=True)
class RateLimiterSettings:
    """The rate limiter's part of the settings (app/core/ratelimit.py), built once by
    `Settings.rate_limiter`: the default limits without their `rate_limit_` prefix, named as a
    tenant's override (`TenantLimits`) names them, and the overrides (`rate_limits`); the fields are
    described in `Settings`."""

    rps: float
    burst: int
    tokens_per_min: int
    embedding_bytes_per_min: int
    tenants: Mapping[str, TenantLimits]  # rate_limits


@dataclass(frozen=True)
class AuthenticatorSettings:
    """The authenticator's part of the settings (app/api/auth.py: the Authenticator and its
    JwtVerifier), built once by `Settings.authenticator`: the auth, api_key* and jwt_* fields, by
    their names in `Settings` (described there). A JWT key file is read by the JwtVerifier when the
    API starts, not here."""

    auth: Literal["keys", "none"]
    api_key_sources: Literal["auto", "both"]
    api_keys: Mapping[str, str]  # SHA-256 hex of a key -> its tenant
    jwt_key: str | None = field(repr=False)  # an HMAC secret, when the algorithms are HS*
    jwt_key_file: Path | None
    jwt_algorithms: tuple[str, ...]
    jwt_audience: str | None
    jwt_issuer: str | None
    jwt_tenant_claims: tuple[str, ...]
    jwt_leeway_s: float
    jwt_max_lifetime_s: float


@dataclass(frozen=True)
class CatalogSettings:
    """The API's model catalog's part of the settings (app/api/catalog.py), built once by
    `Settings.catalog`: where the models a request may name live, those `conveyor up` serves, and
    the routes, by their names in `Settings` (described there)."""

    models: Mapping[str, Path]
    model_home: Path
    served_models: tuple[str, ...]
    routes: Mapping[str, RoutePolicy]

    def model_path(self, name: str) -> Path | None:
        """Where the model called exactly `name` lives (`find_model`); None for no model."""
        return find_model(name, models=self.models, model_home=self.model_home)

    def model_names(self) -> list[str]:
        """Every model a request may name: configured, and added (or pulled) into the model home."""
        return known_models(models=self.models, model_home=self.model_home)


@dataclass(frozen=True)
class PromptEncoderSettings:
    """The prompt encoder's part of the settings (app/api/prompts.py), built once by
    `Settings.prompt_encoder`: the fields it reads, by their names in `Settings` (described there)."""

    max_prompt_chars_per_token: int
    tokenize_threads: int


# The classes of a tenant that CONVEYOR_TENANT_PRIORITIES does not list (nor "*").
UNLISTED_PRIORITIES = frozenset(p for p in PRIORITIES if p != "realtime")


@dataclass(frozen=True)
class JobServiceSettings:
    """The API's job service's part of the settings (app/api/service.py: JobService), built once by
    `Settings.job_service`: the fields it reads, by their names in `Settings` (described there), what
    derives from them, and the sections of the components it builds and holds (admission, the rate
    limiter, the prompt encoder, the webhooks' callback intake), the same objects `Settings` gives.

    A section of the service, named after it as `batcher` and `authenticator` are, rather than one
    `api` section: the API process's other parts are not the service's to carry. The authenticator
    and the catalog are built beside it and take their own sections, and the routes and the app
    factory read what they need (the body limit, health, /v1/models) from the whole `Settings` on
    `app.state`; an `api` section holding their values too would be the whole `Settings` again."""

    namespace: str
    default_model: str
    max_timeout_s: float
    max_tokens_limit: int
    default_max_tokens: int  # at most max_tokens_limit
    max_stop_strings: int
    max_stop_length: int
    max_chat_messages: int
    # The classes each tenant may submit to, aliases resolved ("*": every tenant not listed).
    tenant_priorities: Mapping[str, frozenset[str]]
    tenant_max_streams: int
    embedding_stages: int
    max_embedding_inputs: int
    sync_timeout_s: float
    life: Lifetimes  # of the jobs it cancels (Lifetimes.of)
    admission: AdmissionSettings
    rate_limiter: RateLimiterSettings
    prompt_encoder: PromptEncoderSettings
    webhooks: WebhookSettings

    def allowed_priorities(self, tenant: str) -> frozenset[str]:
        """The classes `tenant` may submit to (aliases resolved): its own list, else `*`'s, else every
        class but `realtime`, which a tenant is given only by name."""
        return self.tenant_priorities.get(tenant, self.tenant_priorities.get("*", UNLISTED_PRIORITIES))


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CONVEYOR_", extra="ignore")

    # Redis: broker, job store, token streams. Unset means "start the embedded server".
    redis_url: str | None = Field(default=None, validation_alias="REDIS_URL")
    # `conveyor up` refuses a REDIS_URL without a password that points beyond this host: whoever
    # reaches such a Redis can add API keys and read every prompt. True: a Redis protected otherwise
    # (a private network of its own, a proxy that authenticates).
    allow_passwordless_redis: bool = False
    embedded_redis_port: int = 6390  # away from 6379 so a system Redis is never shadowed
    # The embedded server's memory bound (Redis's `maxmemory`: bytes, or 100mb, 1gb...; 0: none).
    # Its policy stays noeviction: evicting would drop queued jobs, intake entries or rate-limit
    # state silently; at the bound Redis refuses writes instead, and the API answers them 503
    # store_full with a Retry-After while reads (polls, streams) go on. A gigabyte holds about 80,000
    # ended jobs' records and streams besides the queues; set your own server's in its config.
    embedded_redis_maxmemory: str = Field(default="1gb", pattern=r"^\d+([kKmMgG][bB]?)?$")
    namespace: str = "conveyor"  # prefix of every Redis key and Celery queue; lets stacks share a Redis

    home: Path = Path(".conveyor")  # models, embedded Redis data, logs
    default_model: str = DEFAULT_MODEL  # the model `make run` pulls; jobs that name none get it
    # Extra models by name -> local Hugging Face model directory (JSON in the environment).
    models: dict[str, Path] = Field(default_factory=dict)

    api_host: str = "127.0.0.1"  # local only: turn auth (and TLS) on before binding elsewhere
    api_port: int = 8000  # the HTTP API (and its /metrics)
    # Seconds a client has, from its connection's start and from the end of each answer, to send a
    # request's headers before the API closes the connection (uvicorn itself waits for ever).
    # Headers are a few hundred bytes; 10 s is generous to the slowest link, short for an attacker
    # holding connections open (app/api/connections.py).
    api_header_timeout_s: float = Field(default=10.0, gt=0)
    # HTTPS (`conveyor api --ssl-certfile/--ssl-keyfile`): the oldest TLS version the api accepts. 1.3
    # drops 1.2's negotiable weak ciphers and renegotiation; 1.2 for clients that cannot do 1.3.
    tls_min_version: Literal["1.2", "1.3"] = "1.3"
    flower_port: int = 5555  # Flower's usual port
    # Prometheus metrics of a process other than the api (which serves them at /metrics on its own
    # port): this port; None or 0: not served. `conveyor up` gives each child its own, upwards.
    metrics_port: int | None = 9100
    metrics_host: str = (
        "127.0.0.1"  # as api_host: 0.0.0.0 in containers, where Prometheus scrapes from outside
    )
    flower: bool = True  # `conveyor up` starts Flower, Celery's dashboard
    # "user:password[,user2:password2]": Flower's logins. Unset: `conveyor up` makes one, user `conveyor`
    # with the password in <home>/flower_password (Flower shows every task's arguments: never open).
    flower_basic_auth: str | None = None

    # Request limits. max_tokens caps one job's generation (CPU minutes, KV-cache memory).
    max_tokens_limit: int = 1024
    default_max_tokens: int = 128  # a job that names no max_tokens: a chat answer
    max_stop_strings: int = 4  # OpenAI's limit of 4 stop strings
    max_stop_length: int = 64  # characters per stop string
    # Messages in one chat; past it 422 before anything is rendered. Each message costs its template
    # tokens (about 5 for SmolLM2's), and rendering and tokenizing take API CPU per message: 30,000
    # empty messages fit a 1 MiB body and cost seconds. 1,024 is more than any context holds.
    max_chat_messages: int = Field(default=1024, ge=1)
    # A prompt of more than context length x this many characters is refused (422) before it is
    # tokenized: text averages about 4 characters a token, and even runs of spaces stay under 16, so
    # nothing refused would have fit; a 1 MB prompt would hold a tokenizer thread for half a second.
    max_prompt_chars_per_token: int = Field(default=16, ge=1)
    # Threads that tokenize prompts for the API, off its event loop; past them prompts wait their turn
    # instead of taking every core.
    tokenize_threads: int = Field(default=4, ge=1)

    # Batcher. Jobs per dispatched batch: 32 is where batched CPU decoding stops gaining (raw generate,
    # SmolLM2 on 2 cores: 116.8 tokens/s at batch 32, 115.5 at 64; docs/benchmarks.md).
    max_batch_size: int = 32
    max_wait_ms: float = 50.0  # the batching window: the longest a job waits for batch-mates
    # The minimum batch size: an idle pipeline waits for this many jobs of one bucket, or for
    # the window, before it starts a batch (realtime and high never wait). 1 starts the first job at
    # once, which is what latency wants when the pipeline has nothing else to do.
    min_batch_size: int = Field(default=1, ge=1)
    # Batches in flight (being prefilled, or waiting in the stage queue) per live replica of a model's
    # thinnest stage (at least one replica counted; app/batching/budget.py). A replica's four task
    # threads hold four and 12 wait in the queue: 1.5x the autoscaler's target of 8 waiting per
    # replica (deploy/k8s ScaledObjects), so a saturated stage shows KEDA a queue to scale on.
    replica_batches: int = Field(default=16, ge=1)
    # A fixed number of batches in flight per pipeline, whatever the replicas; None: replica_batches
    # per live replica (and never fewer than stages + 1, which keeps every stage busy).
    max_inflight_batches: int | None = None
    # Continuous batching: a fixed number of sequences scheduled or running per pipeline (the KV cache
    # every stage holds), whatever the replicas; None: max_running_sequences per live replica of the
    # thinnest stage, so a replica added raises it at its first heartbeat and one that stops beating
    # lowers it heartbeat_ttl_s later. realtime and high may exceed it by one batch.
    max_inflight_sequences: int | None = None
    # Prompt-length bucket bounds (tokens): a batch pads to its longest prompt, buckets bound the waste.
    length_buckets: list[int] = Field(default_factory=lambda: [64, 128, 256, 512, 1024, 2048, 4096, 8192])
    # continuous: a batch prefilled while another runs joins it at the next step (Orca, OSDI'22);
    # request: every batch runs alone until its last sequence ends.
    batching: Literal["continuous", "request"] = "continuous"
    # Sequences in one running batch, joiners included; past it a new batch runs on its own.
    max_running_sequences: int = 64
    # Continuous batching: a join pads every row of the merged batch to its longest; a batch joins a
    # running one only if rows x padded positions stays under this (the KV cache a stage holds for
    # one batch: positions x layers x 2 x kv heads x head dim x dtype bytes). 65536 positions is
    # 3 GB for all of SmolLM2-135M's 30 layers in fp32; a joiner that does not fit runs on its own.
    max_batch_kv_positions: int = Field(default=65536, ge=1)
    # Continuous batching: prompt positions (batch size x longest prompt) one prefill batch may hold.
    # A prefill holds its stage as long as it runs; bounding it bounds what a decode step or an urgent
    # prefill waits behind. A longer prompt still goes, alone.
    max_prefill_tokens: int = Field(default=512, ge=1)
    # A realtime or high prefill reaching a stage runs between two layers of the step in progress
    # (which then goes on), instead of waiting for that step to end.
    preempt_between_layers: bool = True
    # An ordinary prefill that has run this long lets the decode steps waiting at its stage run
    # between two of its layers, then goes on: a long prompt holds the running streams for about a
    # slice, not its whole prefill (needs preempt_between_layers). 0 (the default): a prefill runs
    # whole. Off by default: at saturation it cost throughput (docs/benchmarks.md, "A long prompt
    # arriving while streams decode"); 100 suits long prompts beside streaming clients.
    prefill_slice_ms: float = Field(default=0.0, ge=0)
    # At most this many intake entries held by the batcher at once (the rest wait in Redis).
    batcher_max_pending: int = 1024

    # Stage workers.
    stages: int = 1
    # Workers per stage that `conveyor up` starts, sharing the stage's queue (load balancing). The
    # batcher's budget follows the live workers, not this number.
    replicas: int = 1
    plan_file: Path | None = None  # a `conveyor plan --out` file: the layer range of every stage
    device: str = "auto"  # auto: stage k on cuda:k (mod GPUs), else the CPU; or cpu, cuda:N
    # Serving precision of the stage workers: auto picks bf16 on GPUs that have it (fp16 on older
    # ones) and on CPUs with native bf16 (AVX512-BF16 or AMX), else fp32. A model added with
    # `conveyor model add --dtype` keeps its own choice; this is the default for the others.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # Decode steps captured as CUDA graphs (docs/models.md, "Captured decode steps"): auto does it
    # on a GPU and runs a CPU's eagerly (there the fixed layout measured slower); graphs (refused
    # without a GPU) and off (or 0) choose. Prefill always runs eagerly.
    compile: Literal["auto", "graphs", "off", "0", "1"] = "auto"
    # Prefix caching (docs/models.md, "Prefix caching"): each stage keeps the keys and values of the
    # prompts it prefilled, in whole blocks of 16 tokens, and a later prompt that starts with the same
    # tokens (a chat template's system prompt) computes only the rest. MiB per stage worker, least
    # recently used evicted; 0 turns it off. SmolLM2-135M in bf16 holds 23 KB a token: 256 MiB is
    # about 11,000 prompt tokens.
    prefix_cache_mb: int = Field(default=256, ge=0)
    # CPU kernels a worker keeps compiled, in each of torch's two oneDNN caches (its primitive cache
    # and ideep's): one a matmul shape, about 0.6 MB together for a small model. At oneDNN's default
    # of 1,024 a CPU stage worker grows towards ~0.65 GB of them as new prompt shapes come, slowly;
    # a decode step's shapes are a handful, so a smaller cache misses only on one-off prefill shapes.
    cpu_kernel_cache: int = Field(default=256, ge=1)
    # Torch threads of a worker. None: `conveyor up` gives each stage worker its share of the host's
    # cores but one (left to the api, the batcher and Redis); a worker started alone uses every core.
    torch_threads: int | None = None
    # workers: `conveyor up`, when it shares the cores (CONVEYOR_TORCH_THREADS unset), binds each
    # stage worker it starts to CPUs of its own, the first ones, and the api, the batcher, Redis and
    # the other processes to the rest, as vLLM binds its model's threads (skipped where the workers'
    # threads do not fit beside one CPU left over). none: every process runs wherever the OS puts
    # it. Measured within noise on a 2-core machine (docs/benchmarks.md, "Against vLLM").
    cpu_bind: Literal["none", "workers"] = "none"
    # The CPUs a stage or embeddings worker runs on, a list like 0-3,6; empty: wherever the OS puts
    # it. `conveyor up` sets it for the workers it binds; a CPU this process may not use is refused.
    cpus: str = ""
    heartbeat_interval_s: float = 2.0  # how often a worker reports it is live
    heartbeat_ttl_s: float = 10.0  # a worker not heard of for this long is not live

    # Health of a stage replica, judged at each heartbeat from its own report (app/core/health.py):
    # a device hotter or fuller than these, or a Redis round trip slower, marks the replica unhealthy
    # and it takes no new batches; it comes back once health_cooldown_s has passed and a fresh report
    # is under every threshold. 85 C is where GPUs start to throttle (the DeviceTemperatureHigh alert);
    # past 95% of device memory the next batch's KV cache may not fit; 250 ms is a hundred times a
    # healthy round trip in one zone, a network problem that every decode hop pays.
    health_max_temperature_c: float = Field(default=85.0, gt=0)
    health_max_memory_fraction: float = Field(default=0.95, gt=0, le=1)  # the next batch may not fit
    health_max_redis_rtt_ms: float = Field(default=250.0, gt=0)  # a network problem every hop pays
    health_cooldown_s: float = Field(default=30.0, ge=0)  # the breaker's interval: a throttled GPU cools

    # Scheduling and recovery (the batcher). A waiting job rises one priority class per aging_s
    # seconds, so a `batch` job outranks a fresh `realtime` one after 3 x aging_s: nothing starves.
    aging_s: float = 30.0
    # A scheduled or running job with no progress (prefill start, a token) for this long is
    # recovered: prefilled again from its prompt and the tokens it had streamed, on live workers.
    # Well above the slowest step (a 32 x 2048 prefill on a CPU takes seconds).
    stall_timeout_s: float = 30.0
    max_attempts: int = 3  # runs of one job (first run included) before it fails as worker_lost
    monitor_interval_s: float = 1.0  # how often the batcher looks for stalled jobs

    # Record lifetimes: a job's record and event stream live this long from its submit while it runs
    # (a day: longer than any job waits and runs).
    job_ttl_s: int = 86_400
    # Once a job has ended its inputs (prompt token ids, embeddings texts) are dropped and its record
    # and stream live this long: an hour to poll or replay the result. What Redis holds is then about
    # submit rate x this x a few KB, instead of a day of every prompt (tens of KB each).
    ended_job_ttl_s: int = Field(default=3600, ge=1)
    # memory: 202 once Redis holds the job (AOF fsynced every second: a crash of the Redis host can
    # lose the last second of accepted jobs). fsync: 202 once the job is on disk: WAITAOF on Redis
    # 7.2+, else Redis must run with appendfsync always (the embedded one then does); the API refuses
    # to start on a Redis that offers neither (app/core/durability.py).
    submit_durability: Literal["memory", "fsync"] = "memory"
    submit_fsync_timeout_ms: int = Field(default=1000, ge=1)  # WAITAOF's wait; past it 503
    sse_ping_s: float = 15.0  # comment lines keep proxies from closing an idle stream
    sync_timeout_s: float = 600.0  # POST /v1/inference waits this long for a non-streamed result

    celery_events: bool = True  # task events for Flower

    # Stage messages. raw is byte-exact and the fastest (bench/results/codecs.md); arrow is exact too;
    # zfp and a narrower transport dtype are lossy, so opt-in (bfloat16 rather than float16: SmolLM2's
    # activations reach 2.7e4). Tensors of at least claim_check_bytes go through Redis by reference:
    # inline, kombu's JSON + base64 costs CPU at both ends past ~32 KB (bench/results/hop.md).
    # arrow+zstd / arrow+lz4: Arrow IPC with its buffers compressed, byte-exact, fewer bytes on the wire.
    stage_codec: Literal["raw", "arrow", "arrow+zstd", "arrow+lz4", "zfp"] = "raw"
    stage_transport_dtype: Literal["float16", "bfloat16"] | None = None  # unset: the model's dtype
    stage_zfp_tolerance: float = 1e-2  # absolute error bound when the codec is zfp
    claim_check_bytes: int = 32 * 1024  # measured break-even of inline vs by reference: 18 to 37 KB
    claim_ttl_s: float = 3600.0  # as long as the broker's visibility timeout

    # /v1/embeddings: all-MiniLM-L6-v2 cut on its torch.fx graph into this many stage workers
    # (0 turns the endpoint off). Two shows the graph partitioning at work on a small model.
    embedding_stages: int = 2
    max_embedding_inputs: int = 64  # texts per request; each is truncated at 256 tokens

    # Admission and overload (API).
    # A job's timeout_s (time allowed in the queue before it starts) is at most this: an hour.
    max_timeout_s: float = 3600.0
    # Jobs waiting per priority class (its intake stream's length): past it 429 queue_full. About the
    # batcher's window (batcher_max_pending): a deeper queue only adds wait a client gives up on.
    queue_depth_limit: int = Field(default=1000, ge=1)
    # Jobs waiting over every class: past it 503 overloaded (the stack is behind, not one class busy).
    overload_limit: int = Field(default=2000, ge=1)
    # The part of a class's queue_depth_limit one tenant's waiting jobs may fill (at least one job);
    # past it 429 tenant_queue_full while other tenants are still admitted. Half: a tenant that floods
    # a class leaves the other half to everyone else; 1: one tenant may fill the class alone.
    tenant_queue_share: float = Field(default=0.5, gt=0.0, le=1.0)
    # Per-tenant overrides of tenant_queue_share (JSON, tenant -> share): {"batch-import": 0.1}.
    tenant_queue_shares: dict[str, float] = Field(default_factory=dict)
    # Bytes one tenant's jobs may hold in Redis, live and ended until their records expire (each
    # counted at what it may weigh: its prompt, every token it may generate); past it 429
    # tenant_quota_exceeded, so one tenant cannot fill Redis for all. Unset: a quarter of Redis's
    # maxmemory (256 MiB of 1 GB; none on a Redis without maxmemory, nor under auth=none, where
    # there is one tenant); 0: no quota. Per tenant: `retained_bytes` in rate_limits.
    # docs/operations.md ("Sizing") has the arithmetic.
    tenant_retained_bytes: int | None = Field(default=None, ge=0)
    # Retry-After when nothing better is known (Redis away, no measured completion rate): seconds.
    retry_after_s: float = Field(default=2.0, gt=0)
    # Circuit breaker per model pipeline: opens when at least breaker_min_requests jobs ended within
    # breaker_interval_s and breaker_error_threshold of them failed; one probe job after the interval.
    breaker_error_threshold: float = Field(default=0.3, gt=0.0, le=1.0)
    breaker_min_requests: int = Field(default=100, ge=1)  # fewer: a few failures of a quiet model are noise
    breaker_interval_s: float = Field(default=30.0, gt=0.0, le=300.0)  # one-second buckets, read per submit
    # A stage with no live worker for this long refuses submits (503); None: 2 x heartbeat_ttl_s, long
    # enough for the launcher to restart a killed worker (jobs accepted meanwhile wait in the intake).
    stage_down_after_s: float | None = None
    # An Idempotency-Key names its job this long (at most job_ttl_s, so the job outlives its key).
    idempotency_ttl_s: int = Field(default=86_400, ge=1)
    # A client that disconnects from /v1/inference (waiting or streaming) cancels its job.
    cancel_on_disconnect: bool = True

    # OpenAI's Batch API (/v1/files, /v1/batches; docs/batches.md). An uploaded JSONL file's bytes at
    # most: its lines are copied once more when its batch starts, and both live in Redis.
    batch_file_max_bytes: int = Field(default=32 * 1024 * 1024, ge=1)
    # Lines (requests) of one batch's input file at most, as OpenAI allows.
    batch_file_max_lines: int = Field(default=50_000, ge=1)
    # How long files and batches (their records, lines and results) are kept: a week, time to run a
    # batch through its 24 h window and fetch its output.
    batch_file_ttl_s: int = Field(default=7 * 86_400, ge=3600)
    # Bytes of uploaded files one tenant may store at once: past it 429 file_quota_exceeded until it
    # deletes files (or they expire). Output files do not count.
    batch_tenant_file_bytes: int = Field(default=256 * 1024 * 1024, ge=1)
    # The part of the batch class's queue_depth_limit that batches' lines may fill: they are fed as
    # it has room, and the rest is left to jobs submitted with priority `batch` directly.
    batch_feed_share: float = Field(default=0.5, gt=0.0, le=1.0)
    # How often the feeder looks for room, feeds lines, collects the results of ended jobs.
    batch_feed_interval_s: float = Field(default=1.0, gt=0.0, le=60.0)

    # Webhooks. A job's callback_url is sent signed events (app/webhooks/): the dispatcher follows
    # the job's event stream, the callbacks worker POSTs with retries.
    # Standard Webhooks secrets (`whsec_` + base64). Every one signs each delivery, so a receiver that
    # knows any of them verifies during a rotation; `conveyor up` makes one (home/webhook_secret) if unset.
    webhook_secrets: list[str] = Field(default_factory=list)
    # CIDRs a callback may reach although the SSRF guard refuses them (loopback, private, ...): a
    # receiver inside the cluster. Empty: only public addresses.
    webhook_allow_cidrs: list[str] = Field(default_factory=list)
    # Per-tenant signing: each tenant's secret is HMAC-SHA256 of this master key (`whsec_` + base64)
    # with its name and generation, so one tenant cannot sign for another. Unset: every tenant is
    # signed with webhook_secrets; `conveyor up` makes one (home/webhook_master_key) if unset.
    webhook_master_key: str | None = None
    # After a tenant's secret is rotated its previous one signs too, this long (a day): its receivers
    # verify while they are updated.
    webhook_secret_overlap_s: float = Field(default=86_400.0, ge=0)
    webhook_timeout_s: float = Field(default=15.0, gt=0)  # connect, each read, each write
    # Wall-clock limit of one attempt, connect + TLS + send + read together: a receiver that never
    # answers, or trickles a byte a second, holds a delivery thread this long at most.
    webhook_attempt_deadline_s: float = Field(default=10.0, gt=0)
    # Deliveries of one tenant in progress at once, over all callbacks workers: a tenant whose receiver
    # hangs holds this many threads at most and the others keep theirs (webhook_concurrency is 8).
    webhook_tenant_concurrency: int = Field(default=2, ge=1)
    # Events of one tenant waiting for a retry (in Redis); past it a failed event is given up, so one
    # tenant's dead receiver cannot fill Redis with retries.
    webhook_tenant_max_retries: int = Field(default=10_000, ge=1)
    # Attempts of one event (the first included), spaced base x 2^(n-1) with jitter (21 to 42 min of
    # retries at the defaults); no delay over webhook_backoff_max_s. Retries wait in Redis (a sorted
    # set by due time the dispatcher polls), not in a worker's memory.
    webhook_max_attempts: int = Field(default=10, ge=1)
    webhook_backoff_base_s: float = Field(default=5.0, gt=0)  # the first retry after 2.5 to 5 s
    webhook_backoff_max_s: float = Field(default=1800.0, gt=0, le=3000.0)  # Retry-After included
    webhook_token_interval_ms: float = Field(default=500.0, gt=0)  # `token` events batched this long
    webhook_concurrency: int = Field(default=8, ge=1)  # threads of the callbacks worker (I/O bound)
    webhook_log_max: int = Field(default=256, ge=1)  # delivery attempts kept per job (newest)
    # A 410 Gone disables its URL this long: a week, then a URL reused by someone else may try again.
    webhook_disabled_ttl_s: int = Field(default=7 * 86_400, ge=1)

    # Auth, tenants and audit. keys: every request needs an API key or a JWT, and with none configured
    # anywhere every request is refused (401): the API never opens by accident. none: no
    # authentication, every request is tenant "anonymous" (`make run` on a laptop; a WARNING at start).
    auth: Literal["keys", "none"] = "keys"
    # Where API keys are looked up. auto: the keys in api_keys when any are set (a deployment's
    # secrets are then the whole list), else those `conveyor keys create` stored in Redis; both: both.
    api_key_sources: Literal["auto", "both"] = "auto"
    # API keys: SHA-256 hex of the key -> tenant (JSON); keys made by `conveyor keys create` live in Redis.
    api_keys: dict[str, str] = Field(default_factory=dict)
    # Tenants shown what /readyz knows of the deployment's inside: worker names and what each serves,
    # devices, unhealthy replicas, the Redis error. Everyone else sees counts and states only. Under
    # CONVEYOR_AUTH=none the caller is `anonymous`: list it to see them on a laptop.
    admin_tenants: list[str] = Field(default_factory=list)
    # JWT bearer tokens: the verification key (a PEM public key or certificate for RS/PS/ES/EdDSA, the
    # secret for HS*), inline or in a file; algorithms pinned (never taken from the token's header).
    jwt_key: str | None = None
    jwt_key_file: Path | None = None  # the key in a file (a mounted Secret) instead of inline
    # RS256: what identity providers sign with by default. `none`, or HMAC mixed with public-key
    # algorithms, is refused at start.
    jwt_algorithms: list[str] = Field(default_factory=lambda: ["RS256"])
    # Required with a JWT key: `aud` must hold it, so a token the identity provider issued for another
    # service is refused here (an API with a JWT key and no audience does not start).
    jwt_audience: str | None = None
    jwt_issuer: str | None = None  # when set, `iss` must equal it
    jwt_tenant_claims: list[str] = Field(
        default_factory=lambda: ["tenant", "sub"]
    )  # the first present names the tenant
    jwt_leeway_s: float = Field(default=30.0, ge=0)  # clock skew allowed on exp / nbf / iat
    # The longest a token may be valid (`exp - iat`; `iat` is required): a leaked token is good for a
    # day at most. Identity providers issue access tokens for an hour or so.
    jwt_max_lifetime_s: float = Field(default=86400.0, gt=0)
    # Per-tenant rate limits (GCRA in Redis, shared by every API process), on job-creating requests.
    # 0 turns a limit off. The request limit bounds submits per second per tenant; burst is how many
    # may arrive at once. Tokens: max_tokens charged at submit, per minute (a minute's worth at once).
    # 50/s: well above one client's closed loop (the c32 benchmark submits under 10/s), well below what
    # one API process takes.
    rate_limit_rps: float = Field(default=50.0, ge=0)
    rate_limit_burst: int = Field(default=100, ge=1)  # submits a tenant may send at once
    # Off: it depends on the deployment's capacity (a 2-core CPU stack generates about 6,600 tokens a
    # minute); set it when tenants share one.
    rate_limit_tokens_per_min: int = Field(default=0, ge=0)
    # Bytes of embeddings input (UTF-8 texts) per tenant per minute, a minute's worth at once; past it
    # 429 rate_limited. A request counts padded, as a batch computes it: every text as long as its
    # longest (2 bytes a padded token position), or its bytes if more. The texts sit in Redis until
    # their job runs: 16 MiB lets a tenant send sixteen of the largest requests (max_body_bytes) a
    # minute, and no tenant fill Redis with them. 0: off.
    embedding_bytes_per_min: int = Field(default=16 * 1024 * 1024, ge=0)
    # Per-tenant overrides (JSON): {"acme": {"rps": 5, "burst": 10, "tokens_per_min": 20000}}.
    rate_limits: dict[str, TenantLimits] = Field(default_factory=dict)
    # Fair share: tenants waiting in one priority class are served in turn, each in proportion to
    # its weight here (JSON, tenant -> weight; unlisted tenants weigh 1: equal shares).
    tenant_weights: dict[str, float] = Field(default_factory=dict)
    # Priority classes each tenant may submit to (JSON, tenant -> classes; "*" for every tenant not
    # listed). Unlisted, and no "*": every class but realtime, which jumps every queue and so is
    # given by name only. Another class: 403 priority_not_allowed.
    # {"*": ["normal", "batch"], "ops": ["realtime", "high", "normal"]}.
    tenant_priorities: dict[str, list[str]] = Field(default_factory=dict)
    # Event streams (SSE, WebSocket, OpenAI `stream`) one tenant may hold open at once, per API process;
    # past it 429 too_many_streams (0: no cap). Each open stream holds a connection and a task.
    tenant_max_streams: int = Field(default=256, ge=0)
    # Request bodies larger than this are refused (413) before they are parsed: the longest job a
    # 8192-token context allows is tens of KB of JSON, 64 embedding texts a few hundred KB.
    max_body_bytes: int = Field(default=1024 * 1024, ge=1)
    # Audit: one JSON line (logger conveyor.audit) and one entry of the capped `audit` stream per request.
    audit_maxlen: int = Field(default=100_000, ge=1)  # about 40 MB of Redis at ~400 bytes an entry
    # Requests refused before a tenant was known go to a stream of their own, capped at this, so that
    # anyone without a key cannot push the tenants' entries out of the capped `audit` stream.
    audit_unauthenticated_maxlen: int = Field(default=10_000, ge=1)
    audit_prompts: bool = False  # prompt text in the audit entries: off, prompts may be personal data

    # Models served. `conveyor up` sets this to the models it starts workers for (`--model`, and the
    # embeddings model), so that the API refuses (404) a known model nobody serves instead of queueing
    # its jobs, and lists a model in /v1/models while its workers load. Empty (processes started one
    # by one): every configured or added model is accepted; /v1/models lists those with live workers.
    served_models: list[str] = Field(default_factory=list)
    # Routes: a name a request may give as its model, sent to one of two served models by the input
    # (JSON, name -> policy; docs/models.md#routes): {"auto": {"small": "A", "large": "B",
    # "max_prompt_chars": 2000, "max_tokens": 256, "max_complexity": 0.3, "deadline_s": 30}}, the
    # defaults shown (small / large unset: the served models with the fewest / most parameters). Past
    # any threshold a request goes to the large model; a pipeline down or a predicted wait past the
    # deadline sends it to the other. `auto` exists without this whenever two or more generation
    # models are served, with those defaults; naming it here tunes it.
    routes: dict[str, RoutePolicy] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _known_priorities(self) -> Settings:
        known = {*PRIORITIES, *PRIORITY_ALIASES}
        for tenant, classes in self.tenant_priorities.items():
            unknown = sorted(set(classes) - known)
            if unknown:
                raise ValueError(f"tenant_priorities[{tenant!r}] names unknown classes {unknown}")
        if any(w <= 0 for w in self.tenant_weights.values()):
            raise ValueError("tenant_weights must be positive")
        if any(not 0 < share <= 1 for share in self.tenant_queue_shares.values()):
            raise ValueError("tenant_queue_shares must be over 0 and at most 1")
        return self

    @model_validator(mode="after")
    def _route_names(self) -> Settings:
        for name in self.routes:
            if not valid_model_name(name):
                raise ValueError(f"routes: {name[:64]!r} cannot name a route (letters, digits, . _ -)")
            if name in self.models:
                raise ValueError(f"routes: {name!r} is already the name of a model (CONVEYOR_MODELS)")
        return self

    @model_validator(mode="after")
    def _cpu_list(self) -> Settings:
        if self.cpus:
            parse_cpus(self.cpus)  # a malformed list stops the process that reads it, at its start
        return self

    @model_validator(mode="after")
    def _min_batch_within_max(self) -> Settings:
        if self.min_batch_size > self.max_batch_size:
            limits = f"min_batch_size {self.min_batch_size}, max_batch_size {self.max_batch_size}"
            raise ValueError(f"min_batch_size must not exceed max_batch_size ({limits})")
        return self

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """A copy with `update` applied. What a `cached_property` derived from the fields (the
        sections, the model home) is left behind, so the copy derives it again from its own fields
        instead of carrying the original's."""
        copied = super().model_copy(update=update, deep=deep)
        for name in _derived(type(self)):
            copied.__dict__.pop(name, None)
        return copied

    @cached_property
    def model_home(self) -> Path:
        return self.home / "models"

    @cached_property
    def batcher(self) -> BatcherSettings:
        continuous = self.batching == "continuous"
        return BatcherSettings(
            namespace=self.namespace,
            stages=self.stages,
            embedding_stages=self.embedding_stages,
            batcher_max_pending=self.batcher_max_pending,
            monitor_interval_s=self.monitor_interval_s,
            tenant_weights=MappingProxyType(dict(self.tenant_weights)),
            max_batch_size=self.max_batch_size,
            max_wait_s=self.max_wait_ms / 1000.0,
            length_buckets=tuple(sorted(self.length_buckets)),
            aging_s=self.aging_s,
            max_prefill_tokens=self.max_prefill_tokens if continuous else None,
            min_batch_size=self.min_batch_size,
            max_running_sequences=self.max_running_sequences if continuous else None,
            replica_batches=self.replica_batches,
            max_inflight_batches=self.max_inflight_batches,
            max_inflight_sequences=self.max_inflight_sequences,
            stall_timeout_s=self.stall_timeout_s,
            max_attempts=self.max_attempts,
            heartbeat_ttl_s=self.heartbeat_ttl_s,
            life=Lifetimes.of(self),
        )

    @cached_property
    def webhooks(self) -> WebhookSettings:
        return WebhookSettings(
            secrets=tuple(self.webhook_secrets),
            master_key=self.webhook_master_key,
            secret_overlap_s=self.webhook_secret_overlap_s,
            allow_cidrs=tuple(self.webhook_allow_cidrs),
            timeout_s=self.webhook_timeout_s,
            attempt_deadline_s=self.webhook_attempt_deadline_s,
            tenant_concurrency=self.webhook_tenant_concurrency,
            tenant_max_retries=self.webhook_tenant_max_retries,
            max_attempts=self.webhook_max_attempts,
            backoff_base_s=self.webhook_backoff_base_s,
            backoff_max_s=self.webhook_backoff_max_s,
            token_interval_s=self.webhook_token_interval_ms / 1000,
            concurrency=self.webhook_concurrency,
            log_max=self.webhook_log_max,
            disabled_ttl_s=self.webhook_disabled_ttl_s,
            job_ttl_s=self.job_ttl_s,
        )

    @cached_property
    def admission(self) -> AdmissionSettings:
        depth = self.queue_depth_limit
        return AdmissionSettings(
            stages=self.stages,
            embedding_stages=self.embedding_stages,
            heartbeat_ttl_s=self.heartbeat_ttl_s,
            stage_down_after_s=self.stage_down_after_s or 2 * self.heartbeat_ttl_s,
            limits=AdmissionLimits(depth, self.overload_limit, self.retry_after_s),
            breaker=BreakerPolicy(
                error_threshold=self.breaker_error_threshold,
                min_requests=self.breaker_min_requests,
                interval_s=self.breaker_interval_s,
            ),
            tenant_queue_default=queue_share(self.tenant_queue_share, depth),
            tenant_queue_limits=MappingProxyType(
                {tenant: queue_share(share, depth) for tenant, share in self.tenant_queue_shares.items()}
            ),
            idempotency_ttl_s=min(self.idempotency_ttl_s, self.job_ttl_s),
            # One tenant (auth=none): no share to keep; the high-water mark bounds Redis.
            tenant_retained_default=0
            if self.auth == "none" and self.tenant_retained_bytes is None
            else self.tenant_retained_bytes,
            tenant_retained_limits=MappingProxyType(
                {
                    t: limits.retained_bytes
                    for t, limits in self.rate_limits.items()
                    if limits.retained_bytes is not None
                }
            ),
            submit_fsync_timeout_ms=self.submit_fsync_timeout_ms,
            life=Lifetimes.of(self),
        )

    @cached_property
    def rate_limiter(self) -> RateLimiterSettings:
        return RateLimiterSettings(
            rps=self.rate_limit_rps,
            burst=self.rate_limit_burst,
            tokens_per_min=self.rate_limit_tokens_per_min,
            embedding_bytes_per_min=self.embedding_bytes_per_min,
            tenants=MappingProxyType(dict(self.rate_limits)),
        )

    @cached_property
    def authenticator(self) -> AuthenticatorSettings:
        return AuthenticatorSettings(
            auth=self.auth,
            api_key_sources=self.api_key_sources,
            api_keys=MappingProxyType(dict(self.api_keys)),
            jwt_key=self.jwt_key,
            jwt_key_file=self.jwt_key_file,
            jwt_algorithms=tuple(self.jwt_algorithms),
            jwt_audience=self.jwt_audience,
            jwt_issuer=self.jwt_issuer,
            jwt_tenant_claims=tuple(self.jwt_tenant_claims),
            jwt_leeway_s=self.jwt_leeway_s,
            jwt_max_lifetime_s=self.jwt_max_lifetime_s,
        )

    @cached_property
    def prompt_encoder(self) -> PromptEncoderSettings:
        return PromptEncoderSettings(
            max_prompt_chars_per_token=self.max_prompt_chars_per_token,
            tokenize_threads=self.tokenize_threads,
        )

    @cached_property
    def job_service(self) -> JobServiceSettings:
        return JobServiceSettings(
            namespace=self.namespace,
            default_model=self.default_model,
            max_timeout_s=self.max_timeout_s,
            max_tokens_limit=self.max_tokens_limit,
            default_max_tokens=min(self.default_max_tokens, self.max_tokens_limit),
            max_stop_strings=self.max_stop_strings,
            max_stop_length=self.max_stop_length,
            max_chat_messages=self.max_chat_messages,
            tenant_priorities=MappingProxyType(
                {
                    tenant: frozenset(PRIORITY_ALIASES.get(c, c) for c in classes)
                    for tenant, classes in self.tenant_priorities.items()
                }
            ),
            tenant_max_streams=self.tenant_max_streams,
            embedding_stages=self.embedding_stages,
            max_embedding_inputs=self.max_embedding_inputs,
            sync_timeout_s=self.sync_timeout_s,
            life=Lifetimes.of(self),
            admission=self.admission,
            rate_limiter=self.rate_limiter,
            prompt_encoder=self.prompt_encoder,
            webhooks=self.webhooks,
        )

    @cached_property
    def catalog(self) -> CatalogSettings:
        return CatalogSettings(
            models=MappingProxyType(dict(self.models)),
            model_home=self.model_home,
            served_models=tuple(self.served_models),
            routes=MappingProxyType(dict(self.routes)),
        )

    def model_path(self, name: str) -> Path | None:
        """Where the model called exactly `name` lives (`find_model`); None for no model."""
        return find_model(name, models=self.models, model_home=self.model_home)

    def model_names(self) -> list[str]:
        """Every model a request may name: configured, and added (or pulled) into the model home."""
        return known_models(models=self.models, model_home=self.model_home)


def _derived(cls: type) -> list[str]:
    """The names of `cls`'s `cached_property`s, its bases' included."""
    return [
        name
        for klass in cls.__mro__
        for name, value in vars(klass).items()
        if isinstance(value, cached_property)
    ]
