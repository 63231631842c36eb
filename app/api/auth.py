"""Who is calling: API keys and JWT bearer tokens, each naming a tenant.

Credentials come as `Authorization: Bearer <API key or JWT>` or `X-API-Key: <API key>`.

- API keys are random (`cvk_` + 256 bits, `conveyor keys create`); only their SHA-256 is kept, in
  `Settings.api_keys` or the `apikeys` hash in Redis, each naming its tenant. A fast hash is enough
  for a key of that entropy (nobody can search 2^256), and the lookup is by digest, so no key
  material is compared byte by byte.
- A bearer value shaped like a JWT (three dot-separated parts) is verified with PyJWT against the
  configured key, with the algorithms pinned in settings (the token's own `alg` header is never
  trusted: `none`, or HS256 signed with an RS256 public key, is refused); `exp`, `iat` and `aud`
  (`CONVEYOR_JWT_AUDIENCE`, required with a JWT key) are required, `nbf` and `iss` checked, and a
  token valid for longer than `jwt_max_lifetime_s` is refused. The tenant is the first of
  `jwt_tenant_claims` present, as `jwt:<value>`: a token's subject never shares a name with a tenant
  of API keys (whose keys an operator made), so `sub: alice` cannot read API-key tenant alice's jobs.

Who may call is a setting, `Settings.auth` (CONVEYOR_AUTH), so that an API never opens by accident:

- `keys` (the default): every request needs an API key or a JWT. With no credential configured
  anywhere the API refuses everything (401, the body says how to add a key) and says so at start;
  the first `conveyor keys create` lets its tenant in without a restart.
- `none`: no authentication; every request is the tenant `anonymous` (credentials sent anyway, such
  as an OpenAI client's placeholder key, are ignored), counted in
  `conveyor_anonymous_requests_total`, and the API logs a WARNING at start. `make run` chooses it
  for a laptop; credentials configured in settings with it are a contradiction that stops the start.

API keys in settings (`CONVEYOR_API_KEYS`), when any are set, are the only keys accepted (a
deployment's secrets are the whole list); with none in settings, the ones stored in Redis are.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.x509 import load_pem_x509_certificate
from fastapi import Depends, Request
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from starlette.datastructures import Headers

from app.api import audit
from app.core import metrics
from app.core.config import AuthenticatorSettings
from app.core.errors import Unauthorized
from app.core.keys import Keys

log = logging.getLogger(__name__)

ANONYMOUS = "anonymous"
KEY_PREFIX = "cvk_"
MAX_TENANT = 128  # characters of a tenant name: it is part of Redis keys and audit lines
JWT_LEEWAY_S = 30.0  # clock skew allowed on exp / nbf / iat
NO_CREDENTIALS = (
    "this API accepts no credential yet: no API key or JWT key is configured. Create a key with "
    "`conveyor keys create --tenant NAME` (or set CONVEYOR_API_KEYS / CONVEYOR_JWT_KEY), or serve "
    "without authentication with CONVEYOR_AUTH=none"
)
ASYMMETRIC = ("RS", "PS", "ES", "Ed")
JWT_TENANT_PREFIX = "jwt:"  # the namespace of tenants named by tokens


def new_api_key() -> str:
    """A new API key: `cvk_` and 43 characters of base64url (256 random bits)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class Principal:
    tenant: str
    method: str  # "api_key", "jwt" or "anonymous"


def checked_tenant(value: object) -> str:
    """A tenant a credential may name: printable, bounded, and never `anonymous` (the jobs made while
    the API was open belong to nobody who holds a credential)."""
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_TENANT or not value.isprintable():
        raise Unauthorized(f"the tenant must be 1 to {MAX_TENANT} printable characters", invalid=True)
    if value == ANONYMOUS:
        raise Unauthorized(
            f"{ANONYMOUS!r} is reserved for the open API; no credential may name it", invalid=True
        )
    return value


class JwtVerifier:
    """Verifies bearer JWTs with one key and pinned algorithms (all symmetric or all asymmetric).
    `settings`: `Settings.authenticator`."""

    def __init__(self, settings: AuthenticatorSettings) -> None:
        algorithms = list(settings.jwt.algorithms)
        if not algorithms or any(a.lower() == "none" for a in algorithms):
            raise ValueError("CONVEYOR_JWT_ALGORITHMS must name signing algorithms, never 'none'")
        asymmetric = {a.startswith(ASYMMETRIC) for a in algorithms}
        if len(asymmetric) != 1:
            raise ValueError(
                "CONVEYOR_JWT_ALGORITHMS mixes HMAC and public-key algorithms; one key cannot serve both"
            )
        text = settings.jwt.key
        if text is None and settings.jwt.key_file is not None:
            text = read_key_file(settings.jwt.key_file)
        if not text:
            raise ValueError("no JWT key: set CONVEYOR_JWT_KEY or CONVEYOR_JWT_KEY_FILE")
        if not settings.jwt.audience:
            raise ValueError(
                "CONVEYOR_JWT_AUDIENCE is required with a JWT key: tokens must name this API in `aud`, "
                "or a token issued for any other service of the identity provider would be accepted"
            )
        self.key: Any = _public_key(text) if asymmetric == {True} else _secret(text)
        self.algorithms = algorithms
        self.audience = settings.jwt.audience
        self.issuer = settings.jwt.issuer
        self.leeway = JWT_LEEWAY_S
        self.max_lifetime = settings.jwt.max_lifetime_s
        self.claims = list(settings.jwt.tenant_claims)
        self.required = ["exp", "iat", "aud"] + (["iss"] if self.issuer else [])

    def tenant(self, token: str) -> str:
        try:
            payload = jwt.decode(
                token,
                self.key,
                algorithms=self.algorithms,
                audience=self.audience,
                issuer=self.issuer,
                leeway=self.leeway,
                options={"require": self.required},
            )
        except jwt.InvalidTokenError as exc:
            raise Unauthorized(f"invalid token: {exc}", invalid=True) from exc
        lifetime = int(payload["exp"]) - int(payload["iat"])  # PyJWT checked that both are integers
        if lifetime > self.max_lifetime:
            raise Unauthorized(
                f"invalid token: valid for {lifetime:.0f} s, longer than this API accepts "
                f"({self.max_lifetime:.0f} s)",
                invalid=True,
            )
        for claim in self.claims:
            value = payload.get(claim)
            if value is not None:
                checked_tenant(value)
                return checked_tenant(JWT_TENANT_PREFIX + value)
        raise Unauthorized(f"the token names no tenant (claims {self.claims})", invalid=True)


def read_key_file(path: Path) -> str:
    """A key file's text without its trailing newline (`echo secret > file` adds one; an HMAC secret
    with it would differ from the one the tokens were signed with)."""
    return Path(path).read_text().rstrip("\r\n")


def _public_key(text: str) -> Any:
    data = text.encode()
    try:
        if b"CERTIFICATE" in data:
            return load_pem_x509_certificate(data).public_key()
        return serialization.load_pem_public_key(data)
    except ValueError as exc:
        raise ValueError(f"the JWT key is not a PEM public key or certificate: {exc}") from exc


def _secret(text: str) -> bytes:
    if "-----BEGIN" in text:
        raise ValueError("an HMAC algorithm is configured but the JWT key is a PEM key")
    if len(text.encode()) < 32:
        raise ValueError("the JWT HMAC secret must be at least 32 bytes (RFC 7518 3.2)")
    return text.encode()


class Authenticator:
    """One per API process (app.state.auth): turns a request's headers into a Principal.

    Raises ValueError at construction for settings that contradict each other (a bad JWT setting,
    credentials configured while CONVEYOR_AUTH=none): the API does not start. `settings`:
    `Settings.authenticator`."""

    def __init__(self, settings: AuthenticatorSettings, redis: Any, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self.open = settings.auth == "none"
        self.settings_keys = dict(settings.api_keys)
        configured = settings.jwt.key is not None or settings.jwt.key_file is not None
        if self.open and (self.settings_keys or configured):
            raise ValueError(
                "CONVEYOR_AUTH=none serves everyone as 'anonymous', yet API keys or a JWT key are "
                "configured: set CONVEYOR_AUTH=keys to use them, or remove them"
            )
        self.jwt = JwtVerifier(settings) if configured else None
        # Keys in settings are the whole list: Redis's are looked up only without them.
        self.redis_keys = not self.settings_keys

    @property
    def configured(self) -> bool:
        """Credentials in settings (Redis keys are looked up separately)."""
        return bool(self.settings_keys) or self.jwt is not None

    async def has_credentials(self) -> bool:
        """Some credential could pass: one in settings, or a key stored in Redis (when used)."""
        if self.configured:
            return True
        return self.redis_keys and bool(await self.redis.hlen(self.keys.api_keys()))

    async def authenticate(self, headers: Headers) -> Principal:
        if self.open:
            metrics.ANONYMOUS_REQUESTS.inc()
            return Principal(ANONYMOUS, "anonymous")
        scheme, _, value = headers.get("authorization", "").partition(" ")
        bearer = value.strip() if scheme.lower() == "bearer" else ""
        api_key = headers.get("x-api-key", "").strip()
        if bearer and bearer.count(".") == 2:
            if self.jwt is None:
                raise Unauthorized(
                    "JWT bearer tokens are not accepted here (no JWT key configured)", invalid=True
                )
            return Principal(self.jwt.tenant(bearer), "jwt")
        key = bearer or api_key
        if not key:
            if not await self.has_credentials():
                raise Unauthorized(NO_CREDENTIALS, reason="no_credentials_configured")
            raise Unauthorized(
                "credentials required: send 'Authorization: Bearer <API key or JWT>' "
                "or 'X-API-Key: <API key>'"
            )
        return Principal(await self._tenant_of_key(key), "api_key")

    async def _tenant_of_key(self, key: str) -> str:
        digest = key_digest(key)
        tenant = self.settings_keys.get(digest)
        if tenant is None and self.redis_keys:
            raw = await self.redis.hget(self.keys.api_keys(), digest)
            tenant = _stored_tenant(raw) if raw is not None else None
        if tenant is None:
            raise Unauthorized("invalid API key", invalid=True)
        return checked_tenant(tenant)


def _stored_tenant(raw: bytes | str) -> str:
    return str(json.loads(raw)["tenant"])


# The schemes are declared for the OpenAPI document (/docs' Authorize button); the Authenticator reads
# the headers itself, so a missing or malformed header is its 401, not FastAPI's 403.
_BEARER = HTTPBearer(auto_error=False, description="An API key or a JWT.")
_API_KEY = APIKeyHeader(name="X-API-Key", auto_error=False, description="An API key.")


async def authenticate(
    request: Request,
    _bearer: HTTPAuthorizationCredentials | None = Depends(_BEARER),
    _key: str | None = Depends(_API_KEY),
) -> Principal:
    """The FastAPI dependency every protected router carries (app/api/app.py); FastAPI caches it per
    request, so a route asking for `current_tenant` too does not authenticate twice."""
    principal = await request.app.state.auth.authenticate(request.headers)
    audit.note(request, tenant=principal.tenant)
    return principal  # type: ignore[no-any-return]


async def current_tenant(principal: Principal = Depends(authenticate)) -> str:
    return principal.tenant
