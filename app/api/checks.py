"""What the API checks of a request before any work, from the settings alone (`Settings.job_service`):
its limits (timeout, max_tokens, stop strings, chat messages, embeddings inputs), the tenant's
entitled classes, and its Idempotency-Key (scoped to its tenant). Each refusal is a domain error the
API maps to its HTTP problem."""

from __future__ import annotations

import hashlib

from app.api.auth import ANONYMOUS
from app.api.schemas import JobCreate
from app.core.config import EMBEDDING_MODEL, JobServiceSettings
from app.core.discovery import EMBEDDING, kind_of
from app.core.errors import InvalidRequest, MaxTokensExceeded, ModelNotFound, NotServed, PriorityNotAllowed
from app.core.keys import PRIORITIES, PRIORITY_ALIASES

MAX_IDEMPOTENCY_KEY = 255
MAX_TIMEOUT_S = 3600.0  # a job's timeout_s (time allowed in the queue before it starts): an hour at most
MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_STOP_LENGTH = 64  # characters per stop string
# Messages in one chat; past it 422 before anything is rendered. Each message costs its template
# tokens (about 5 for SmolLM2's), and rendering and tokenizing take API CPU per message: 30,000
# empty messages fit a 1 MiB body and cost seconds. 1,024 is more than any context holds.
MAX_CHAT_MESSAGES = 1024
MAX_EMBEDDING_INPUTS = 64  # texts per embeddings request; each is truncated at 256 tokens


def checked_request(settings: JobServiceSettings, request: JobCreate) -> tuple[int, list[str]]:
    """What costs nothing to check: timeout_s, max_tokens, min_tokens, the stop strings; the job's
    max_tokens (the default filled in) and stop strings."""
    if request.timeout_s is not None and request.timeout_s > MAX_TIMEOUT_S:
        raise InvalidRequest(
            f"timeout_s is {request.timeout_s:g}, over the limit of {MAX_TIMEOUT_S:g}",
            limit=MAX_TIMEOUT_S,
        )
    max_tokens = request.max_tokens or settings.default_max_tokens
    if max_tokens > settings.max_tokens_limit:
        raise MaxTokensExceeded(
            f"max_tokens is {max_tokens}, over the limit of {settings.max_tokens_limit}",
            limit=settings.max_tokens_limit,
        )
    if request.min_tokens > max_tokens:
        raise InvalidRequest(
            f"min_tokens is {request.min_tokens}, over max_tokens ({max_tokens})", limit=max_tokens
        )
    stop = request.stop_list()
    check_stop(stop)
    check_messages(len(request.messages or ()))
    return max_tokens, stop


def check_entitled(settings: JobServiceSettings, tenant: str, priority: str) -> None:
    """Refuse a class the tenant may not submit to (CONVEYOR_TENANT_PRIORITIES), before any work."""
    allowed = settings.allowed_priorities(tenant)
    wanted = PRIORITY_ALIASES.get(priority, priority)
    if allowed is not None and wanted not in allowed:
        raise PriorityNotAllowed(
            f"tenant {tenant!r} may not submit {priority} jobs; allowed: "
            f"{[p for p in PRIORITIES if p in allowed]}",
            priority=priority,
            allowed=[p for p in PRIORITIES if p in allowed],
        )


def check_messages(count: int) -> None:
    """Refuse a chat of more than MAX_CHAT_MESSAGES messages (422), before any work on them."""
    if count > MAX_CHAT_MESSAGES:
        raise InvalidRequest(
            f"the chat has {count} messages, over the limit of {MAX_CHAT_MESSAGES}",
            limit=MAX_CHAT_MESSAGES,
            messages=count,
        )


def check_stop(stop: list[str]) -> None:
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(
            f"at most {MAX_STOP_STRINGS} stop strings are allowed",
            limit=MAX_STOP_STRINGS,
        )
    if any(not s or len(s) > MAX_STOP_LENGTH for s in stop):
        raise InvalidRequest(
            f"stop strings must be 1 to {MAX_STOP_LENGTH} characters long",
            limit=MAX_STOP_LENGTH,
        )


def check_embeddings(settings: JobServiceSettings, texts: list[str], model: str | None) -> None:
    if settings.embedding_stages <= 0:
        raise NotServed("embeddings are not served here (CONVEYOR_EMBEDDING_STAGES=0)")
    if kind_of(model or EMBEDDING_MODEL) != EMBEDDING:
        raise ModelNotFound(
            f"embeddings model {model!r} does not exist; available: {[EMBEDDING_MODEL]}", model=model
        )
    limit = MAX_EMBEDDING_INPUTS
    if not 1 <= len(texts) <= limit or not all(texts):
        raise InvalidRequest(f"input must hold 1 to {limit} non-empty texts", limit=limit)


def checked_key(key: str) -> str:
    if not 1 <= len(key) <= MAX_IDEMPOTENCY_KEY or not key.isprintable():
        raise InvalidRequest(f"Idempotency-Key must be 1 to {MAX_IDEMPOTENCY_KEY} printable characters")
    return key


def idempotency_digest(tenant: str, key: str) -> str:
    """Idempotency-Keys are per tenant: two tenants' `order-1` are two keys. (The anonymous tenant's
    digest is the bare key's, as before tenants existed.)"""
    key = checked_key(key)
    return digest(key if tenant == ANONYMOUS else f"{tenant}\n{key}")


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
