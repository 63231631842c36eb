"""Standard Webhooks signatures (https://www.standardwebhooks.com/), our own HMAC-SHA256.

A delivery carries three headers:

    webhook-id:        the event's id, the same on every retry (receivers dedupe on it)
    webhook-timestamp: unix seconds of this attempt (receivers refuse stale ones, 5 min by default)
    webhook-signature: `v1,<base64 HMAC-SHA256(secret, "{id}.{timestamp}.{body}")>`, one per active
                       secret, space-separated, so a receiver holding any of them verifies during a
                       rotation

Secrets are `whsec_` + base64 of the key bytes. A tenant given its own secret (`conveyor keys create`)
has its deliveries signed with that secret only: HMAC-SHA256(master key, tenant, generation), derived
on each attempt from `CONVEYOR_WEBHOOK_MASTER_KEY` and the tenant's generation in Redis, so no tenant
secret is stored anywhere and rotating one is a new generation. A tenant without one (`anonymous`,
or one made before per-tenant secrets) is signed with the settings' list, as before.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import os
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from app.core.keys import Keys
from app.core.scripts import Script

PREFIX = "whsec_"
KEY_BYTES = 32  # what a generated secret holds; the spec asks for 24 to 64
DERIVATION = b"conveyor-webhook-secret/v1"  # domain separation: the master key signs nothing else

# Rotate a tenant's secret: the next generation, and since when the previous one still signs too.
# K.tenants: every tenant's record. A: tenant, now.
ROTATE_LUA = """
local raw = redis.call('HGET', K.tenants, A.tenant)
local generation = 0
if raw then generation = cjson.decode(raw)['generation'] end
local record = cjson.encode({generation = generation + 1, rotated_at = A.now})
redis.call('HSET', K.tenants, A.tenant, record)
return generation + 1
"""


@dataclass(frozen=True)
class Secret:
    key: bytes

    @classmethod
    def parse(cls, text: str) -> Secret:
        """`whsec_<base64>` (the prefix is optional, padding too, as the reference libraries accept)."""
        body = text.strip().removeprefix(PREFIX)
        try:
            key = base64.b64decode(body + "=" * (-len(body) % 4), validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError("a webhook secret must be 'whsec_' followed by base64") from exc
        if not key:
            raise ValueError("a webhook secret may not be empty")
        return cls(key)

    def sign(self, webhook_id: str, timestamp: int, body: bytes) -> str:
        message = f"{webhook_id}.{timestamp}.".encode() + body
        digest = hmac.new(self.key, message, hashlib.sha256).digest()
        return "v1," + base64.b64encode(digest).decode("ascii")


def generate() -> str:
    return PREFIX + base64.b64encode(secrets.token_bytes(KEY_BYTES)).decode("ascii")


def signature_header(webhook_id: str, timestamp: int, body: bytes, keys: Sequence[Secret]) -> str:
    if not keys:
        raise ValueError("no webhook secret to sign with")
    return " ".join(k.sign(webhook_id, timestamp, body) for k in keys)


def headers(webhook_id: str, timestamp: int, body: bytes, keys: Sequence[Secret]) -> dict[str, str]:
    """The request headers of one attempt (content type included)."""
    return {
        "content-type": "application/json",
        "webhook-id": webhook_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": signature_header(webhook_id, timestamp, body, keys),
    }


OPEN_TENANT = "anonymous"  # the tenant of every job of an API without authentication (app/api/auth.py)


class SecretSource(Protocol):
    def for_tenant(self, tenant: str | None) -> tuple[Secret, ...]: ...


def derive(master: Secret, tenant: str, generation: int) -> Secret:
    """Tenant `tenant`'s secret of generation `generation`: HMAC-SHA256(master, label, tenant, generation),
    with NUL separators (a tenant name is printable, so no two (tenant, generation) pairs collide)."""
    message = b"\0".join((DERIVATION, tenant.encode(), str(generation).encode()))
    return Secret(hmac.new(master.key, message, hashlib.sha256).digest())


def encode(secret: Secret) -> str:
    return PREFIX + base64.b64encode(secret.key).decode("ascii")


@dataclass(frozen=True)
class TenantRecord:
    """A tenant's entry in the `webhooks:tenants` hash: its current generation, and when it was made."""

    generation: int
    rotated_at: float

    @classmethod
    def decode(cls, raw: bytes | str) -> TenantRecord:
        data = json.loads(raw)
        return cls(int(data["generation"]), float(data["rotated_at"]))


def rotate(redis: Any, keys: Keys, tenant: str, *, now: float | None = None) -> int:
    """Give `tenant` a new secret generation (its first creates it); the generation. Called by
    `conveyor keys create` and `conveyor keys webhook-secret --rotate`."""
    rotated = Script(redis, ROTATE_LUA)
    return int(
        rotated(keys={"tenants": keys.webhook_tenants()}, args={"tenant": tenant, "now": now or time.time()})
    )


def generation(redis: Any, keys: Keys, tenant: str) -> int | None:
    raw = redis.hget(keys.webhook_tenants(), tenant)
    return TenantRecord.decode(raw).generation if raw is not None else None


# After a tenant's secret is rotated its previous one signs too, this long (a day): its receivers
# verify while they are updated.
SECRET_OVERLAP_S = 86_400.0


class TenantSecrets:
    """Which secrets sign a tenant's deliveries: the callbacks worker asks on every attempt, so a
    rotation takes effect at once. With a master key, every named tenant gets its own derived secret:
    generation 1 until `conveyor keys` first rotates it (`keys create` and `rotate-webhook-secret` on
    a tenant without a record make generation 1, the same secret), the current generation after
    that, and for `overlap_s` after a rotation the previous one's too (one signature each, so a
    receiver still holding the old secret verifies while it is updated). `default` (the shared
    secrets) signs only the open API's jobs (tenant `anonymous`) and, without a master key, every
    job: a deployment with API keys or JWTs sets the master key (the callbacks worker refuses to
    start without it)."""

    def __init__(
        self,
        default: Sequence[str],
        *,
        master: str | None,
        redis: Any,
        keys: Keys,
        overlap_s: float = SECRET_OVERLAP_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.default = tuple(Secret.parse(s) for s in default)
        self.master = Secret.parse(master) if master else None
        self.redis = redis
        self.keys = keys
        self.overlap_s = overlap_s
        self.clock = clock

    def for_tenant(self, tenant: str | None) -> tuple[Secret, ...]:
        if tenant is None or tenant == OPEN_TENANT or self.master is None:
            return self.default
        raw = self.redis.hget(self.keys.webhook_tenants(), tenant)
        if raw is None:
            return (derive(self.master, tenant, 1),)
        record = TenantRecord.decode(raw)
        current = derive(self.master, tenant, record.generation)
        if record.generation > 1 and self.clock() - record.rotated_at < self.overlap_s:
            return (current, derive(self.master, tenant, record.generation - 1))
        return (current,)


class SecretBook:
    """A fixed book of secrets: one list for everyone, a tenant's own list in `by_tenant` (tests, and
    the receivers' examples); the callbacks worker uses `TenantSecrets`."""

    def __init__(self, default: Sequence[str], by_tenant: Mapping[str, Sequence[str]] | None = None) -> None:
        self.default = tuple(Secret.parse(s) for s in default)
        self.by_tenant = {t: tuple(Secret.parse(s) for s in ss) for t, ss in (by_tenant or {}).items()}

    def for_tenant(self, tenant: str | None) -> tuple[Secret, ...]:
        if tenant is not None and tenant in self.by_tenant:
            return self.by_tenant[tenant]
        return self.default


def ensure_secret_file(path: Path) -> str:
    """The secret kept at `path`, made (owner-only) on first use: `conveyor up` signs with it when
    CONVEYOR_WEBHOOK_SECRETS is unset, so a restart keeps the secret receivers already trust."""
    if path.exists():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    secret = generate()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    return secret
