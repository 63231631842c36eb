"""Secrets that were once committed as examples, refused at start.

Older deployment files (deploy/k8s/base/secrets.example.env, flower.example.env, docker-compose.yml)
held example values: an API key, an HS256 JWT secret, webhook signing secrets and Flower's password.
They are public (they are in git's history), so a process configured with any of them would accept
anyone's forged tokens or signatures. The api, the callbacks worker and `conveyor up` call
`refuse_known_secrets` first and stop with a message naming the setting; nothing compares a secret
with these lists anywhere else.
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path
from urllib.parse import urlsplit

from app.core.config import Settings

# sha256 of the example API key "example-key-change-me"
KNOWN_API_KEY_DIGESTS = frozenset({"22a60ff8c666ee7f81ede927b1adfb38922412b0bbd7162b99525a22607f603b"})
KNOWN_JWT_KEYS = frozenset({"example-jwt-secret-change-me-at-least-32-bytes"})
# The key bytes of the example webhook secrets (compared decoded: any spelling of the same key counts).
KNOWN_WEBHOOK_KEYS = frozenset(
    {
        b"example-webhook-secret-change-me",  # the Kubernetes example
        b"development-only-compose-secret",  # docker-compose's old default
    }
)
KNOWN_PASSWORDS = frozenset({"change-me", "changeme", "password", "admin", "REPLACE_ME"})


class KnownSecret(ValueError):
    """A configured secret is one of the published examples."""


def _webhook_key(text: str) -> bytes | None:
    body = text.strip().removeprefix("whsec_")
    try:
        return base64.b64decode(body + "=" * (-len(body) % 4), validate=True)
    except (binascii.Error, ValueError):
        return None  # malformed: the signing code refuses it with its own message


def _file_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""  # unreadable: the JWT verifier stops the start with its own message


def known_secrets_in_use(settings: Settings) -> list[str]:
    """The settings (by environment variable name) that hold a published example value."""
    found = []
    if KNOWN_API_KEY_DIGESTS & {digest.lower() for digest in settings.api_keys}:
        found.append("CONVEYOR_API_KEYS (the example key 'example-key-change-me')")
    if settings.jwt.key is not None and settings.jwt.key.strip() in KNOWN_JWT_KEYS:
        found.append("CONVEYOR_JWT_KEY")
    if settings.jwt.key_file is not None and _file_text(settings.jwt.key_file).strip() in KNOWN_JWT_KEYS:
        found.append(f"CONVEYOR_JWT_KEY_FILE ({settings.jwt.key_file})")
    if any(_webhook_key(s) in KNOWN_WEBHOOK_KEYS for s in settings.webhook.secrets):
        found.append("CONVEYOR_WEBHOOK_SECRETS")
    if settings.webhook.master_key and _webhook_key(settings.webhook.master_key) in KNOWN_WEBHOOK_KEYS:
        found.append("CONVEYOR_WEBHOOK_MASTER_KEY")
    if settings.flower_basic_auth:
        passwords = {pair.partition(":")[2] for pair in settings.flower_basic_auth.split(",")}
        if passwords & KNOWN_PASSWORDS:
            found.append("CONVEYOR_FLOWER_BASIC_AUTH")
    if settings.redis_url and urlsplit(settings.redis_url).password in KNOWN_PASSWORDS:
        found.append("REDIS_URL (its password)")
    return found


def refuse_known_secrets(settings: Settings) -> None:
    """Raise KnownSecret naming every setting that holds a published example value."""
    found = known_secrets_in_use(settings)
    if found:
        raise KnownSecret(
            "refusing to start: these settings hold example values published in Conveyor's repository, "
            f"which anyone can use: {', '.join(found)}. Generate real ones (docs/security.md, 'Secrets')"
        )
