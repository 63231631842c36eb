"""The sections of the settings: the part of `Settings` each component is handed
(`Settings.batcher`, `.admission`, `.job_service`, ...), and the types of the settings that hold
mappings (`TenantLimits`, `RoutePolicy`). A section's fields are named as in `Settings`, which
declares and describes them; `build` fills a section from the settings of the same names, so a
section spells out only what it derives (a limit clamped, milliseconds as seconds, a default).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from app.core.breaker import Policy as BreakerPolicy
from app.core.discovery import EMBEDDING, find_model, kind_of, known_models
from app.core.errors import RETRY_AFTER_S
from app.core.jobstore import Lifetimes
from app.core.keys import PRIORITIES, PRIORITY_ALIASES

T = TypeVar("T")
# A section of the settings: read-only, and its variables' unknown names ignored, as `Settings` ignores them.
SECTION = ConfigDict(frozen=True, extra="ignore")


def build(cls: type[T], settings: object, *, prefix: str = "", **derived: Any) -> T:
    """The section `cls` of `settings`: each of its fields from the setting named `prefix` + the
    field's name (a list as a tuple, a mapping read-only), unless `derived` gives it."""
    values = dict(derived)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name not in values:
            value = getattr(settings, prefix + f.name)
            if isinstance(value, list):
                value = tuple(value)
            elif isinstance(value, dict):
                value = MappingProxyType(dict(value))
            values[f.name] = value
    return cls(**values)


def pipeline_stages(model: str, *, stages: int, embedding_stages: int) -> int:
    """How many stages `model`'s pipeline has: an embeddings model its own count, every generation
    model `stages`. One answer for the API's admission and the batcher's census and monitor."""
    return embedding_stages if kind_of(model) == EMBEDDING else stages


class TenantLimits(BaseModel):
    """One tenant's rate limits (`Settings.rate_limits`); a field left out keeps the default."""

    model_config = ConfigDict(extra="forbid")

    rps: float | None = Field(default=None, ge=0)
    burst: int | None = Field(default=None, ge=1)  # None: 2 x its rps, rounded up
    tokens_per_min: int | None = Field(default=None, ge=0)
    embedding_bytes_per_min: int | None = Field(default=None, ge=0)
    retained_bytes: int | None = Field(default=None, ge=0)  # TenantSettings.retained_bytes


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
class BatcherSettings:
    """The batcher's part of the settings (app/batching/scheduler.py), built once by
    `Settings.batcher`: the fields it reads, by their names in `Settings` (described there), and
    what derives from them computed here."""

    namespace: str
    stages: int
    embedding_stages: int
    tenant_weights: Mapping[str, float]
    max_batch_size: int
    max_wait_s: float  # max_wait_ms
    aging_s: float
    max_prefill_tokens: int
    min_batch_size: int
    max_running_sequences: int
    stall_timeout_s: float
    heartbeat_ttl_s: float
    life: (
        Lifetimes  # of the jobs it publishes for (Settings.lifetimes): job_ttl_s, ended_job_ttl_s, stream cap
    )

    def stages_of(self, model: str) -> int:
        return pipeline_stages(model, stages=self.stages, embedding_stages=self.embedding_stages)


@dataclass(frozen=True)
class AdmissionLimits:
    """Admission's queue limits (app/core/admission.py, gates 3 and 4, and the write script that
    checks them again) and the Retry-After it answers when no completion rate is measured."""

    class_depth: int  # queue_depth_limit
    overall: int  # over every class: 2 x queue_depth_limit
    retry_after_s: float = RETRY_AFTER_S


@dataclass(frozen=True)
class AdmissionSettings:
    """Admission's part of the settings (app/core/admission.py: the gates and the write), built once
    by `Settings.admission`: the fields it reads, by their names in `Settings` (described there), and
    what derives from them computed here: the stage-down grace, the queue limits, the circuit
    breaker's policy, each tenant's queue limit and the job lifetimes."""

    stages: int
    embedding_stages: int
    heartbeat_ttl_s: float
    stage_down_after_s: float  # 2 x heartbeat_ttl_s
    limits: AdmissionLimits  # queue_depth_limit, and twice it over every class
    breaker: BreakerPolicy  # the circuit breaker's thresholds (app/core/breaker.py: Policy's defaults)
    # Jobs of one tenant that may wait in one class: TENANT_QUEUE_SHARE of queue_depth_limit, and
    # each of tenant_queue_shares' tenants its own share of it.
    tenant_queue_default: int
    tenant_queue_limits: Mapping[str, int]
    # Bytes of jobs one tenant may keep in Redis (tenant_retained_bytes, and rate_limits' per-tenant
    # retained_bytes); None: derived from Redis's maxmemory (`retained_quota`); 0: no quota.
    tenant_retained_default: int | None
    tenant_retained_limits: Mapping[str, int]
    life: Lifetimes  # of the jobs it writes (Settings.lifetimes)

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
# The share of a class's queue_depth_limit a tenant's waiting jobs may fill, unless tenant_queue_shares
# gives it its own: half, so a tenant that floods a class leaves the other half to everyone else.
TENANT_QUEUE_SHARE = 0.5
TENANT_FILES = 8  # a tenant's uploaded files may hold this many times batch_file_max_bytes


def queue_share(share: float, depth: int) -> int:
    """`share` of a class's `depth` jobs, rounded down, at least one."""
    return max(1, int(share * depth + 1e-9))  # 0.29 x 100 is 28.999... in floats


@dataclass(frozen=True)
class RateLimiterSettings:
    """The rate limiter's part of the settings (app/core/ratelimit.py), built once by
    `Settings.rate_limiter`: the default limits without their `rate_limit_` prefix, named as a
    tenant's override (`TenantLimits`) names them, and the overrides (`rate_limits`); the fields are
    described in `Settings`."""

    rps: float  # its burst: 2 x this, rounded up (app/core/ratelimit.py, default_burst)
    tokens_per_min: int
    embedding_bytes_per_min: int
    tenants: Mapping[str, TenantLimits]  # rate_limits


@dataclass(frozen=True)
class AuthenticatorSettings:
    """The authenticator's part of the settings (app/api/auth.py: the Authenticator and its
    JwtVerifier), built once by `Settings.authenticator`: the auth and api_keys fields, by their
    names in `Settings` (described there), and the JWT section."""

    auth: Literal["keys", "none"]
    api_keys: Mapping[str, str]  # SHA-256 hex of a key -> its tenant
    jwt: JwtSettings


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


# The classes of a tenant that CONVEYOR_TENANT_PRIORITIES does not list (nor "*").
UNLISTED_PRIORITIES = frozenset(p for p in PRIORITIES if p != "realtime")


@dataclass(frozen=True)
class JobServiceSettings:
    """The API's job service's part of the settings (app/api/service.py: JobService), built once by
    `Settings.job_service`: the fields it reads, by their names in `Settings` (described there), what
    derives from them, and the sections of the components it builds and holds (admission, the rate
    limiter, the webhooks' callback intake), the same objects `Settings` gives.

    A section of the service, named after it as `batcher` and `authenticator` are, rather than one
    `api` section: the API process's other parts are not the service's to carry. The authenticator
    and the catalog are built beside it and take their own sections, and the routes and the app
    factory read what they need (the body limit, health, /v1/models) from the whole `Settings` on
    `app.state`; an `api` section holding their values too would be the whole `Settings` again."""

    namespace: str
    default_model: str
    max_tokens_limit: int
    default_max_tokens: int  # at most max_tokens_limit
    # The classes each tenant may submit to, aliases resolved ("*": every tenant not listed).
    tenant_priorities: Mapping[str, frozenset[str]]
    tenant_max_streams: int
    embedding_stages: int
    life: Lifetimes  # of the jobs it cancels (Settings.lifetimes)
    admission: AdmissionSettings
    rate_limiter: RateLimiterSettings
    webhooks: WebhookSettings

    def allowed_priorities(self, tenant: str) -> frozenset[str]:
        """The classes `tenant` may submit to (aliases resolved): its own list, else `*`'s, else every
        class but `realtime`, which a tenant is given only by name."""
        return self.tenant_priorities.get(tenant, self.tenant_priorities.get("*", UNLISTED_PRIORITIES))


class BatchSettings(BaseModel):
    """OpenAI's Batch API: its files, batches and their feeder (app/api/batchfeed.py): CONVEYOR_BATCH_*,
    read as `Settings.batch.<name>`."""

    model_config = SECTION

    # OpenAI's Batch API (/v1/files, /v1/batches; docs/batches.md). An uploaded JSONL file's bytes at
    # most: its lines are copied once more when its batch starts, and both live in Redis. One tenant
    # may store eight times this in uploaded files at once (256 MiB): past it 429 file_quota_exceeded
    # until it deletes files (or they expire). Output files do not count.
    file_max_bytes: int = Field(default=32 * 1024 * 1024, ge=1)

    @property
    def tenant_file_bytes(self) -> int:
        """Bytes of uploaded files one tenant may store at once: eight of the largest."""
        return TENANT_FILES * self.file_max_bytes


class WebhookSettings(BaseModel):
    """Webhooks (app/webhooks/: the dispatcher, the callbacks worker, the API's callback intake):
    CONVEYOR_WEBHOOK_*, read as `Settings.webhook.<name>`."""

    model_config = SECTION

    # Webhooks. A job's callback_url is sent signed events (app/webhooks/): the dispatcher follows
    # the job's event stream, the callbacks worker POSTs with retries.
    # Standard Webhooks secrets (`whsec_` + base64). Every one signs each delivery, so a receiver that
    # knows any of them verifies during a rotation; `conveyor up` makes one (home/webhook_secret) if unset.
    secrets: list[str] = Field(default_factory=list)
    # CIDRs a callback may reach although the SSRF guard refuses them (loopback, private, ...): a
    # receiver inside the cluster. Empty: only public addresses.
    allow_cidrs: list[str] = Field(default_factory=list)
    # Per-tenant signing: each tenant's secret is HMAC-SHA256 of this master key (`whsec_` + base64)
    # with its name and generation, so one tenant cannot sign for another. Required where the API
    # checks credentials (the callbacks worker exits without it); `conveyor up` makes one
    # (home/webhook_master_key) if unset. Only the open API's jobs are signed with webhook_secrets.
    master_key: str | None = None
    # Threads of the callbacks worker (I/O bound); one tenant holds two at most
    # (app/webhooks/delivery.py, TENANT_CONCURRENCY).
    concurrency: int = Field(default=8, ge=1)


class JwtSettings(BaseModel):
    """JWT bearer tokens (app/api/auth.py's JwtVerifier): CONVEYOR_JWT_*, read as `Settings.jwt.<name>`.
    A key file is read by the JwtVerifier when the API starts, not here."""

    model_config = SECTION

    # JWT bearer tokens: the verification key (a PEM public key or certificate for RS/PS/ES/EdDSA, the
    # secret for HS*), inline or in a file; algorithms pinned (never taken from the token's header).
    key: str | None = Field(default=None, repr=False)
    key_file: Path | None = None  # the key in a file (a mounted Secret) instead of inline
    # RS256: what identity providers sign with by default. `none`, or HMAC mixed with public-key
    # algorithms, is refused at start.
    algorithms: list[str] = Field(default_factory=lambda: ["RS256"])
    # Required with a JWT key: `aud` must hold it, so a token the identity provider issued for another
    # service is refused here (an API with a JWT key and no audience does not start).
    audience: str | None = None
    issuer: str | None = None  # when set, `iss` must equal it
    tenant_claims: list[str] = Field(
        default_factory=lambda: ["tenant", "sub"]
    )  # the first present names the tenant
    # The longest a token may be valid (`exp - iat`; `iat` is required): a leaked token is good for a
    # day at most. Identity providers issue access tokens for an hour or so.
    max_lifetime_s: float = Field(default=86400.0, gt=0)


class AuditSettings(BaseModel):
    """The audit log of requests (app/api/audit.py): CONVEYOR_AUDIT_*, read as `Settings.audit.<name>`."""

    model_config = SECTION

    # Audit: one JSON line (logger conveyor.audit) and one entry of the capped `audit` stream per request.
    maxlen: int = Field(default=100_000, ge=1)  # about 40 MB of Redis at ~400 bytes an entry
    prompts: bool = False  # prompt text in the audit entries: off, prompts may be personal data


class TenantSettings(BaseModel):
    """Tenants: their shares of the queues and of Redis, fair-share weights, entitled classes and
    open streams: CONVEYOR_TENANT_*, read as `Settings.tenant.<name>`."""

    model_config = SECTION

    # The part of a class's queue_depth_limit one tenant's waiting jobs may fill (at least one job),
    # per tenant (JSON, tenant -> share): {"batch-import": 0.1}; past it 429 tenant_queue_full while
    # other tenants are still admitted. Unlisted: half, so a tenant that floods a class leaves the
    # other half to everyone else; 1: the tenant may fill the class alone.
    queue_shares: dict[str, float] = Field(default_factory=dict)
    # Bytes one tenant's jobs may hold in Redis, live and ended until their records expire (each
    # counted at what it may weigh: its prompt, every token it may generate); past it 429
    # tenant_quota_exceeded, so one tenant cannot fill Redis for all. Unset: a quarter of Redis's
    # maxmemory (256 MiB of 1 GB; none on a Redis without maxmemory, nor under auth=none, where
    # there is one tenant); 0: no quota. Per tenant: `retained_bytes` in rate_limits.
    # docs/operations.md ("Sizing") has the arithmetic.
    retained_bytes: int | None = Field(default=None, ge=0)
    # Fair share: tenants waiting in one priority class are served in turn, each in proportion to
    # its weight here (JSON, tenant -> weight; unlisted tenants weigh 1: equal shares).
    weights: dict[str, float] = Field(default_factory=dict)
    # Priority classes each tenant may submit to (JSON, tenant -> classes; "*" for every tenant not
    # listed). Unlisted, and no "*": every class but realtime, which jumps every queue and so is
    # given by name only. Another class: 403 priority_not_allowed.
    # {"*": ["normal", "batch"], "ops": ["realtime", "high", "normal"]}.
    priorities: dict[str, list[str]] = Field(default_factory=dict)
    # Event streams (SSE, WebSocket, OpenAI `stream`) one tenant may hold open at once, per API process;
    # past it 429 too_many_streams (0: no cap). Each open stream holds a connection and a task.
    max_streams: int = Field(default=256, ge=0)

    @model_validator(mode="after")
    def _known_classes_and_positive_weights(self) -> TenantSettings:
        known = {*PRIORITIES, *PRIORITY_ALIASES}
        for tenant, classes in self.priorities.items():
            unknown = sorted(set(classes) - known)
            if unknown:
                raise ValueError(f"tenant_priorities[{tenant!r}] names unknown classes {unknown}")
        if any(w <= 0 for w in self.weights.values()):
            raise ValueError("tenant_weights must be positive")
        if any(not 0 < share <= 1 for share in self.queue_shares.values()):
            raise ValueError("tenant_queue_shares must be over 0 and at most 1")
        return self


# The sections `Settings` holds, by name: CONVEYOR_<NAME>_<SETTING> is `Settings.<name>.<setting>`.
SECTIONS: dict[str, type[BaseModel]] = {
    "tenant": TenantSettings,
    "batch": BatchSettings,
    "webhook": WebhookSettings,
    "jwt": JwtSettings,
    "audit": AuditSettings,
}
