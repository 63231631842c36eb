"""The one place that reads the environment.

Every process builds a `Settings` at start-up (never at import) and passes it down explicitly.
Each setting is a tunable with a default and a reason, written as a comment above or beside it, here
or in its section (app/core/sections.py): docs/configuration.md is generated from those comments.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from functools import cached_property
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, Self

from pydantic import BaseModel, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from app.core.breaker import Policy as BreakerPolicy
from app.core.cpus import parse_cpus
from app.core.discovery import DEFAULT_MODEL, find_model, known_models, valid_model_name
from app.core.discovery import EMBEDDING_MAX_TOKENS as EMBEDDING_MAX_TOKENS  # by name from here too
from app.core.discovery import EMBEDDING_MODEL as EMBEDDING_MODEL
from app.core.jobstore import EVENTS_BESIDE_TOKENS, Lifetimes
from app.core.keys import PRIORITY_ALIASES
from app.core.sections import (
    SECTIONS,
    TENANT_QUEUE_SHARE,
    AdmissionLimits,
    AdmissionSettings,
    AuditSettings,
    AuthenticatorSettings,
    BatcherSettings,
    BatchSettings,
    CatalogSettings,
    JobServiceSettings,
    JwtSettings,
    RateLimiterSettings,
    RoutePolicy,
    TenantLimits,
    TenantSettings,
    WebhookSettings,
    build,
    queue_share,
)


class Settings(BaseSettings):
    # A section's variables are its name and the setting's: CONVEYOR_WEBHOOK_CONCURRENCY is
    # webhook.concurrency.
    model_config = SettingsConfigDict(
        env_prefix="CONVEYOR_", extra="ignore", env_nested_delimiter="_", env_nested_max_split=1
    )

    # Redis: broker, job store, token streams. Unset means "start the embedded server".
    redis_url: str | None = Field(default=None, validation_alias="REDIS_URL")
    # `conveyor up` refuses a password-less REDIS_URL beyond this host (whoever reaches it can add API
    # keys and read every prompt). True: a Redis protected otherwise (a private network, a proxy).
    allow_passwordless_redis: bool = False
    embedded_redis_port: int = 6390  # away from 6379 so a system Redis is never shadowed
    # The embedded server's `maxmemory` (bytes, or 100mb, 1gb...; 0: none), policy noeviction: at the
    # bound writes are refused (submits 503 store_full, Retry-After) while reads go on; evicting would
    # drop queued jobs silently. 1 GB holds about 80,000 ended jobs besides the queues.
    embedded_redis_maxmemory: str = Field(default="1gb", pattern=r"^\d+([kKmMgG][bB]?)?$")
    namespace: str = "conveyor"  # prefix of every Redis key and Celery queue; lets stacks share a Redis

    home: Path = Path(".conveyor")  # models, embedded Redis data, logs
    default_model: str = DEFAULT_MODEL  # the model `make run` pulls; jobs that name none get it
    # Extra models by name -> local Hugging Face model directory (JSON in the environment).
    models: dict[str, Path] = Field(default_factory=dict)

    api_host: str = "127.0.0.1"  # local only: turn auth (and TLS) on before binding elsewhere
    api_port: int = 8000  # the HTTP API (and its /metrics)
    # Host names the API answers (port aside; `.example.com`: it and its subdomains; `*`: any); others
    # get 400 host_not_allowed, against DNS rebinding. Health, readiness and /metrics answer any Host.
    allowed_hosts: list[str] = Field(default_factory=lambda: ["localhost", "127.0.0.1", "::1"])
    # Browser origins (`https://app.example.com`; `*`: any) that may open a job's WebSocket besides the
    # API's own; other pages get close code 4403. Clients that send no Origin (CLI, Python) are accepted.
    allowed_origins: list[str] = Field(default_factory=list)
    # Flower, Celery's dashboard, on this port (5555: its usual one): `conveyor up` starts it, and the
    # workers send it their task events. 0: neither (`conveyor up --no-flower`).
    flower_port: int = Field(default=5555, ge=0)
    # Prometheus metrics of a process other than the api (which serves /metrics on its own port): this
    # port on api_host's address, `conveyor up` giving each child its own upwards; None or 0: none.
    metrics_port: int | None = 9100
    # "user:password[,user2:password2]": Flower's logins. Unset: `conveyor up` makes one, user `conveyor`
    # with the password in <home>/flower_password (Flower shows every task's arguments: never open).
    flower_basic_auth: str | None = None

    # Request limits. max_tokens caps one job's generation (CPU minutes, KV-cache memory).
    max_tokens_limit: int = 1024
    default_max_tokens: int = 128  # a job that names no max_tokens: a chat answer

    # Batcher. Jobs per dispatched batch: 32 is where batched CPU decoding stops gaining (raw generate,
    # SmolLM2 on 2 cores: 116.8 tokens/s at batch 32, 115.5 at 64; docs/benchmarks.md).
    max_batch_size: int = 32
    max_wait_ms: float = 50.0  # the batching window: the longest a job waits for batch-mates
    # The minimum batch size: an idle pipeline waits for this many jobs of one bucket, or for
    # the window, before it starts a batch (realtime and high never wait). 1 starts the first job at
    # once, which is what latency wants when the pipeline has nothing else to do.
    min_batch_size: int = Field(default=1, ge=1)
    # Sequences in one running batch, joiners included; past it a new batch runs on its own. Also one
    # live replica's share of its pipeline's sequences scheduled or running (the KV cache every stage
    # holds): the pipeline takes this many per live replica of its thinnest stage
    # (app/batching/budget.py), so a replica added raises it at its first heartbeat and one that stops
    # beating lowers it heartbeat_ttl_s later. realtime and high may exceed it by one batch. On the
    # step engine: the scheduler's sequences, and the batcher sends what the replicas advertise free.
    max_running_sequences: int = 64
    # Continuous batching: a join pads every row of the merged batch to its longest; a batch joins a
    # running one only if rows x padded positions stays under this (the KV cache a stage holds for
    # one batch: positions x layers x 2 x kv heads x head dim x dtype bytes). 65536 positions is
    # 3 GB for all of SmolLM2-135M's 30 layers in fp32; a joiner that does not fit runs on its own.
    # On the step engine: its paged KV cache (and prefix cache), whose free blocks the batcher sends
    # prompts against, reserved at the worker's start and resident as its blocks are used: 65536
    # positions of SmolLM2-135M are 1.5 GB in bf16 (3 GB in fp32), the stage worker about 0.95 GB
    # resident at start and up to 2.4 GB once they have all been used (1.1 and 4 GB in fp32).
    max_batch_kv_positions: int = Field(default=65536, ge=1)
    # Continuous batching: prompt positions (batch size x longest prompt) one prefill batch may hold.
    # A prefill holds its stage as long as it runs; bounding it bounds what a decode step or an urgent
    # prefill waits behind. A longer prompt still goes, alone. On the step engine: the tokens of one
    # step (decode rows and prompt chunks); the batcher does not bound its batches by it.
    max_prefill_tokens: int = Field(default=512, ge=1)

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
    # without a GPU) and off choose. Prefill always runs eagerly.
    compile: Literal["auto", "graphs", "off"] = "auto"
    # What decides a pipeline's steps (docs/architecture.md, "The step engine"): batch runs the
    # batcher's windows as batches that join running ones; step admits their jobs into stage 0's step
    # scheduler over paged KV caches (ragged steps, chunked prefill, a plan in flight per stage).
    # auto: step for a pipeline on CPUs whose model ragged steps can run (not a rope that depends on a
    # sequence's length), batch otherwise (GPUs).
    engine: Literal["auto", "batch", "step"] = "auto"
    # Prefix caching (docs/models.md, "Prefix caching"): each stage keeps the keys and values of the
    # prompts it prefilled, in whole blocks of 16 tokens, and a later prompt that starts with the same
    # tokens (a chat template's system prompt) computes only the rest. MiB per stage worker, least
    # recently used evicted; 0 turns it off. SmolLM2-135M in bf16 holds 23 KB a token: 256 MiB is
    # about 11,000 prompt tokens. On the step engine the cache is the KV cache's own free blocks (no
    # budget of its own); 0 turns it off there too.
    prefix_cache_mb: int = Field(default=256, ge=0)
    # Torch threads of a worker, fixed. None: `conveyor up` gives each worker its share of the host's
    # cores but one (left to the api, the batcher and Redis; alone, every core but one), and a stage
    # worker widens to the other cores while they idle (docs/architecture.md, "Threads").
    torch_threads: int | None = None
    # The CPUs a stage or embeddings worker runs on, a list like 0-3,6; empty: wherever the OS puts
    # it. A CPU this process may not use is refused.
    cpus: str = ""
    # A worker not heard of for this long is not live. It reports five times as often (every 2 s), so
    # a lost beat or two (a GC pause, a slow Redis) never makes a live worker look gone. A stage with
    # no live worker for twice this refuses submits (503 stage_unavailable): long enough for the
    # launcher to restart a killed worker (jobs accepted meanwhile wait in the intake).
    heartbeat_ttl_s: float = 10.0

    # Scheduling and recovery (the batcher). A waiting interactive job rises one priority class per
    # aging_s seconds, so a `normal` job outranks a fresh `realtime` one after 2 x aging_s: nothing
    # starves. The `batch` class does not age: it runs on what the interactive classes leave.
    aging_s: float = 30.0
    # A scheduled or running job with no progress (prefill start, a token) for this long is
    # recovered: prefilled again from its prompt and the tokens it had streamed, on live workers.
    # Well above the slowest step (a 32 x 2048 prefill on a CPU takes seconds).
    stall_timeout_s: float = 30.0

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

    # /v1/embeddings: all-MiniLM-L6-v2 cut on its torch.fx graph into this many stage workers
    # (0 turns the endpoint off). One serves it whole in one worker: a 22M-parameter encoder gains
    # nothing from a cut (two workers answered one text in 29-32 ms against 24 ms, with twice the
    # memory: bench/results/embedding-stages.md); more cut it, one piece per worker.
    embedding_stages: int = 1

    # Admission and overload (API).
    # Jobs waiting per priority class (its intake stream's length): past it 429 queue_full. About the
    # batcher's window (1,024 intake entries): a deeper queue only adds wait a client gives up on.
    # Jobs waiting over every class past twice this (2000): 503 overloaded (the stack is behind, not
    # one class busy).
    queue_depth_limit: int = Field(default=1000, ge=1)
    tenant: TenantSettings = Field(default_factory=TenantSettings)  # CONVEYOR_TENANT_*, app/core/sections.py

    batch: BatchSettings = Field(default_factory=BatchSettings)  # CONVEYOR_BATCH_*, app/core/sections.py

    webhook: WebhookSettings = Field(
        default_factory=WebhookSettings
    )  # CONVEYOR_WEBHOOK_*, app/core/sections.py

    # Auth, tenants and audit. keys: every request needs an API key or a JWT, and with none configured
    # anywhere every request is refused (401): the API never opens by accident. none: no
    # authentication, every request is tenant "anonymous" (`make run` on a laptop; a WARNING at start).
    auth: Literal["keys", "none"] = "keys"
    # API keys: SHA-256 hex of the key -> tenant (JSON). When any are set they are the whole list (a
    # deployment's secrets); else the keys `conveyor keys create` stored in Redis are looked up.
    api_keys: dict[str, str] = Field(default_factory=dict)
    # Tenants shown what /readyz knows of the deployment's inside: worker names and what each serves,
    # devices, unhealthy replicas, the Redis error. Everyone else sees counts and states only. Under
    # CONVEYOR_AUTH=none the caller is `anonymous`: list it to see them on a laptop.
    admin_tenants: list[str] = Field(default_factory=list)
    jwt: JwtSettings = Field(default_factory=JwtSettings)  # CONVEYOR_JWT_*, app/core/sections.py
    # Per-tenant rate limits (GCRA in Redis, shared by every API process), on job-creating requests.
    # 0 turns a limit off. The request limit bounds submits per second per tenant, two seconds' worth
    # of them at once (the burst: 2 x this, rounded up). Tokens: max_tokens charged at submit, per
    # minute (a minute's worth at once). 50/s: well above one client's closed loop (the c32 benchmark
    # submits under 10/s), well below what one API process takes.
    rate_limit_rps: float = Field(default=50.0, ge=0)
    # Off: it depends on the deployment's capacity (a 2-core CPU stack generates about 6,600 tokens a
    # minute); set it when tenants share one.
    rate_limit_tokens_per_min: int = Field(default=0, ge=0)
    # Bytes of embeddings input (UTF-8 texts) per tenant per minute, a minute's worth at once; past it
    # 429 rate_limited. A request counts padded, as a batch computes it: every text as long as its
    # longest (2 bytes a padded token position), or its bytes if more. The texts sit in Redis until
    # their job runs: 16 MiB lets a tenant send sixteen of the largest requests (max_body_bytes) a
    # minute, and no tenant fill Redis with them. 0: off.
    embedding_bytes_per_min: int = Field(default=16 * 1024 * 1024, ge=0)
    # Per-tenant overrides (JSON): {"acme": {"rps": 5, "burst": 10, "tokens_per_min": 20000}}; a
    # tenant given rps without burst may send 2 x its rps at once.
    rate_limits: dict[str, TenantLimits] = Field(default_factory=dict)
    # Request bodies larger than this are refused (413) before they are parsed: the longest job a
    # 8192-token context allows is tens of KB of JSON, 64 embedding texts a few hundred KB.
    max_body_bytes: int = Field(default=1024 * 1024, ge=1)
    audit: AuditSettings = Field(default_factory=AuditSettings)  # CONVEYOR_AUDIT_*, app/core/sections.py

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

    @model_validator(mode="before")
    @classmethod
    def _sections_by_variable_names(cls, data: Any) -> Any:
        """`Settings(webhook_concurrency=5)` as CONVEYOR_WEBHOOK_CONCURRENCY reads: a section's setting
        by its variable's name, beside (and over) what the environment gave the section."""
        if not isinstance(data, dict):
            return data
        for name, given in _by_section(data).items():
            inner = data.get(name) or {}
            data[name] = {**(inner.model_dump() if isinstance(inner, BaseModel) else inner), **given}
        return data

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
        """A copy with `update` applied (a section's settings by their variables' names too, as
        `Settings(...)` takes them). What a `cached_property` derived from the fields (the sections,
        the model home) is left behind, so the copy derives it again from its own fields instead of
        carrying the original's."""
        update = dict(update or {})
        for name, given in _by_section(update).items():
            update[name] = getattr(self, name).model_copy(update=given)
        copied = super().model_copy(update=update, deep=deep)
        for name in _derived(type(self)):
            copied.__dict__.pop(name, None)
        return copied

    @property
    def flower(self) -> bool:
        """Flower runs (`conveyor up`) and the workers send it task events: flower_port is not 0."""
        return self.flower_port != 0

    @property
    def heartbeat_interval_s(self) -> float:
        """How often a worker reports it is live: five beats per heartbeat_ttl_s."""
        return self.heartbeat_ttl_s / 5

    @cached_property
    def model_home(self) -> Path:
        return self.home / "models"

    @cached_property
    def lifetimes(self) -> Lifetimes:
        """A job's lifetimes, for the API, the batcher and the workers alike: its record and stream
        while live and once ended, and its stream's cap (room for every token and a few events)."""
        maxlen = self.max_tokens_limit + EVENTS_BESIDE_TOKENS
        return Lifetimes(ttl_s=self.job_ttl_s, ended_ttl_s=self.ended_job_ttl_s, stream_maxlen=maxlen)

    @cached_property
    def batcher(self) -> BatcherSettings:
        return build(
            BatcherSettings,
            self,
            max_wait_s=self.max_wait_ms / 1000.0,
            tenant_weights=MappingProxyType(dict(self.tenant.weights)),
            life=self.lifetimes,
        )

    @cached_property
    def admission(self) -> AdmissionSettings:
        depth = self.queue_depth_limit
        retained = {t: limits.retained_bytes for t, limits in self.rate_limits.items()}
        return build(
            AdmissionSettings,
            self,
            stage_down_after_s=2 * self.heartbeat_ttl_s,
            limits=AdmissionLimits(depth, 2 * depth),
            breaker=BreakerPolicy(),
            tenant_queue_default=queue_share(TENANT_QUEUE_SHARE, depth),
            tenant_queue_limits=MappingProxyType(
                {tenant: queue_share(share, depth) for tenant, share in self.tenant.queue_shares.items()}
            ),
            # One tenant (auth=none): no share to keep; the high-water mark bounds Redis.
            tenant_retained_default=0
            if self.auth == "none" and self.tenant.retained_bytes is None
            else self.tenant.retained_bytes,
            tenant_retained_limits=MappingProxyType({t: b for t, b in retained.items() if b is not None}),
            life=self.lifetimes,
        )

    @cached_property
    def rate_limiter(self) -> RateLimiterSettings:
        return build(
            RateLimiterSettings,
            self,
            prefix="rate_limit_",
            embedding_bytes_per_min=self.embedding_bytes_per_min,
            tenants=MappingProxyType(dict(self.rate_limits)),
        )

    @cached_property
    def authenticator(self) -> AuthenticatorSettings:
        return build(AuthenticatorSettings, self)

    @cached_property
    def job_service(self) -> JobServiceSettings:
        priorities = {
            tenant: frozenset(PRIORITY_ALIASES.get(c, c) for c in classes)
            for tenant, classes in self.tenant.priorities.items()
        }
        return build(
            JobServiceSettings,
            self,
            default_max_tokens=min(self.default_max_tokens, self.max_tokens_limit),
            tenant_priorities=MappingProxyType(priorities),
            tenant_max_streams=self.tenant.max_streams,
            life=self.lifetimes,
            webhooks=self.webhook,
        )

    @cached_property
    def catalog(self) -> CatalogSettings:
        return build(CatalogSettings, self)

    def model_path(self, name: str) -> Path | None:
        """Where the model called exactly `name` lives (`find_model`); None for no model."""
        return find_model(name, models=self.models, model_home=self.model_home)

    def model_names(self) -> list[str]:
        """Every model a request may name: configured, and added (or pulled) into the model home."""
        return known_models(models=self.models, model_home=self.model_home)


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """The CONVEYOR_* variables of `environ` (the process's environment by default) that no setting
    reads: a typo, or a setting since removed (CHANGELOG.md says what became of it). Every command
    warns of them at its start (`load_settings`), as `Settings` itself ignores them."""
    prefix = str(Settings.model_config.get("env_prefix", "")).upper()
    fields = [name for name in Settings.model_fields if name not in SECTIONS]
    fields += [f"{section}_{name}" for section, model in SECTIONS.items() for name in model.model_fields]
    known = {prefix + name.upper() for name in fields}
    given = os.environ if environ is None else environ
    return sorted(k for k in given if k.upper().startswith(prefix) and k.upper() not in known)


def _derived(cls: type) -> list[str]:
    """The names of `cls`'s `cached_property`s, its bases' included."""
    return [
        name
        for klass in cls.__mro__
        for name, value in vars(klass).items()
        if isinstance(value, cached_property)
    ]


def _by_section(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Take out of `values` the settings named by their variables (`webhook_concurrency`), by section."""
    found: dict[str, dict[str, Any]] = {}
    for key in [k for k in values if "_" in k and k.split("_", 1)[0] in SECTIONS]:
        section, name = key.split("_", 1)
        found.setdefault(section, {})[name] = values.pop(key)
    return found
