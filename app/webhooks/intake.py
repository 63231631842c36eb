"""The API's side of webhooks: vet a submit's callback before anything is written.

Called by `JobService.submit`; the job record then carries its url and events (`JobRecord.callback_*`),
and the admission script registers the job with the dispatcher in the same atomic write.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from app.core.config import WebhookSettings
from app.core.errors import NotServed
from app.core.keys import Keys
from app.webhooks.delivery import disabled_digest
from app.webhooks.events import DEFAULT_EVENTS
from app.webhooks.ssrf import CallbackRefused, Guard, Reason

DNS_TIMEOUT_S = 5.0  # a name that takes longer to resolve is refused as unresolvable


@dataclass(frozen=True)
class Callback:
    url: str
    events: tuple[str, ...]


class CallbackIntake:
    def __init__(self, settings: WebhookSettings, redis: Any, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self.configured = bool(settings.secrets)
        self.guard = Guard(settings.allow_cidrs)

    async def check(self, url: str, events: Sequence[str] | None, *, tenant: str) -> Callback:
        """The callback `tenant` may store; raises CallbackRefused (422) or NotServed (no signing
        secret)."""
        if not self.configured:
            raise NotServed("webhooks are not configured here: set CONVEYOR_WEBHOOK_SECRETS")
        try:
            await asyncio.wait_for(asyncio.to_thread(self.guard.check, url), DNS_TIMEOUT_S)
        except TimeoutError as exc:
            raise CallbackRefused(
                f"callback host did not resolve within {DNS_TIMEOUT_S:g} s", reason=Reason.UNRESOLVABLE
            ) from exc
        if await self.redis.exists(self.keys.webhook_disabled(disabled_digest(tenant, url))):
            raise CallbackRefused(
                "callback URL is disabled: it answered 410 Gone to an earlier delivery",
                reason=Reason.DISABLED,
            )
        return Callback(url, tuple(dict.fromkeys(events)) if events else DEFAULT_EVENTS)
