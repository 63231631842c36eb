"""Standard Webhooks signatures (https://www.standardwebhooks.com/), our own HMAC-SHA256.

A delivery carries three headers:

    webhook-id:        the event's id, the same on every retry (receivers dedupe on it)
    webhook-timestamp: unix seconds of this attempt (receivers refuse stale ones, 5 min by default)
    webhook-signature: `v1,<base64 HMAC-SHA256(secret, "{id}.{timestamp}.{body}")>`, one per active
                       secret, space-separated, so a receiver holding any of them verifies during a
                       rotation

Secrets are `whsec_` + base64 of the key bytes. They belong to a tenant; until tenants exist every
job is signed with the settings' list (`SecretBook.for_tenant(None)`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

PREFIX = "whsec_"
KEY_BYTES = 32  # what a generated secret holds; the spec asks for 24 to 64


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


class SecretBook:
    """Which secrets sign a tenant's deliveries. Today one list for everyone (settings); a tenant's own
    list goes in `by_tenant` once tenants exist, and jobs already carry the tenant to look up."""

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
