"""One tenant cannot sign another tenant's webhooks: each tenant given its own secret (`conveyor keys
create`) has its deliveries signed with that secret only, derived from the master key and the tenant's
generation; a named tenant without a record has its generation-1 secret; only the open API's jobs
(tenant `anonymous`) are signed with the shared secret, and the callbacks worker of an API with keys
does not start without a master key.

A real receiver on loopback (allow-listed), the real delivery code and a real Redis, in process; the
CLI as an operator runs it."""

from __future__ import annotations

import base64
import json
import os
import uuid
from collections.abc import Iterator

import pytest
from click.testing import Result
from standardwebhooks.webhooks import Webhook, WebhookVerificationError
from typer.testing import CliRunner

from app.cli import cli
from app.core.config import Settings
from app.core.keys import Keys
from app.webhooks import signing
from app.webhooks.delivery import Deliverer
from app.webhooks.ssrf import Guard
from tests.receivers import Receiver, receiving

SHARED = "whsec_" + base64.b64encode(b"shared-secret-of-untenanted-jobs").decode()
MASTER = signing.generate()


@pytest.fixture()
def receiver() -> Iterator[Receiver]:
    with receiving() as server:
        yield server


@pytest.fixture()
def setup(redis, redis_url: str) -> Iterator[tuple[Settings, Keys]]:  # type: ignore[no-untyped-def]
    settings = Settings(
        redis_url=redis_url,
        namespace=f"test-{uuid.uuid4().hex[:8]}",
        webhook_secrets=[SHARED],
        webhook_master_key=MASTER,
        webhook_allow_cidrs=["127.0.0.1/32"],
    )
    keys = Keys(settings.namespace)
    yield settings, keys
    redis.delete(
        keys.webhook_tenants(), keys.api_keys(), keys.webhook_retries(), keys.webhook_retry_messages()
    )


def deliver(redis, settings: Settings, keys: Keys, url: str, tenant: str | None) -> None:  # type: ignore[no-untyped-def]
    secrets = signing.TenantSecrets(
        settings.webhook.secrets, master=settings.webhook.master_key, redis=redis, keys=keys, overlap_s=0
    )
    guard = Guard(settings.webhook.allow_cidrs)
    deliverer = Deliverer(
        redis, keys, settings.webhook, guard=guard, secrets=secrets, job_ttl_s=settings.job_ttl_s
    )
    job_id = uuid.uuid4().hex
    body = json.dumps({"type": "job.completed", "timestamp": "2026-01-01T00:00:00Z", "data": {"id": job_id}})
    message = {
        "job_id": job_id,
        "webhook_id": f"msg_{job_id}_completed",
        "type": "completed",
        "url": url,
        "tenant": tenant,
        "body": body,
    }
    deliverer.deliver(message)
    redis.delete(keys.webhook_deliveries(job_id), keys.webhook_outcomes(job_id))


def secret_of(tenant: str, generation: int) -> str:
    return signing.encode(signing.derive(signing.Secret.parse(MASTER), tenant, generation))


def test_a_delivery_for_tenant_a_verifies_with_a_secret_only(redis, setup, receiver) -> None:  # type: ignore[no-untyped-def]
    settings, keys = setup
    assert signing.rotate(redis, keys, "tenant-a") == 1
    assert signing.rotate(redis, keys, "tenant-b") == 1
    deliver(redis, settings, keys, receiver.url(), "tenant-a")
    ((headers, body),) = receiver.received

    payload = Webhook(secret_of("tenant-a", 1)).verify(body, headers)  # A's secret verifies
    assert payload["type"] == "job.completed"
    for forger in (secret_of("tenant-b", 1), SHARED):  # B's secret, or the shared one, does not
        with pytest.raises(WebhookVerificationError):
            Webhook(forger).verify(body, headers)
    assert len(headers["webhook-signature"].split()) == 1  # one signature: A's, nothing shared

    # What tenant B can sign with its own secret does not pass A's receiver: cross-tenant forgery fails.
    forged = signing.headers(
        headers["webhook-id"],
        int(headers["webhook-timestamp"]),
        body.encode(),
        [signing.Secret.parse(secret_of("tenant-b", 1))],
    )
    with pytest.raises(WebhookVerificationError):
        Webhook(secret_of("tenant-a", 1)).verify(body, forged)


def test_a_tenant_without_a_record_is_signed_with_its_own_first_secret_never_the_shared_one(
    redis, setup, receiver
) -> None:  # type: ignore[no-untyped-def]
    """A tenant named only by a JWT or CONVEYOR_API_KEYS (no `keys create`): its own generation-1
    secret, the one `rotate-webhook-secret` then gives it; only the open API's jobs get the shared one."""
    settings, keys = setup
    deliver(redis, settings, keys, receiver.url(), "jwt-tenant")  # no record
    deliver(redis, settings, keys, receiver.url(), "anonymous")  # the open API's tenant
    deliver(redis, settings, keys, receiver.url(), None)  # a job without a tenant
    (own_headers, own_body), *shared = receiver.received
    Webhook(secret_of("jwt-tenant", 1)).verify(own_body, own_headers)
    with pytest.raises(WebhookVerificationError):
        Webhook(SHARED).verify(own_body, own_headers)
    assert len(shared) == 2
    for headers, body in shared:
        Webhook(SHARED).verify(body, headers)
    assert signing.rotate(redis, keys, "jwt-tenant") == 1  # what the operator is then shown: the same secret


def test_the_callbacks_worker_refuses_to_start_with_api_keys_and_no_master_key(redis_url: str) -> None:
    from app.webhooks.worker import run_callbacks_worker

    settings = Settings(redis_url=redis_url, auth="keys", webhook_secrets=[SHARED], webhook_master_key=None)
    with pytest.raises(SystemExit, match="CONVEYOR_WEBHOOK_MASTER_KEY"):
        run_callbacks_worker(settings)


def test_rotation_signs_with_the_new_generation_and_the_old_one_for_the_overlap(
    redis, setup, receiver
) -> None:  # type: ignore[no-untyped-def]
    settings, keys = setup
    signing.rotate(redis, keys, "tenant-a", now=1000.0)
    signing.rotate(redis, keys, "tenant-a", now=2000.0)
    book = signing.TenantSecrets(
        [SHARED], master=MASTER, redis=redis, keys=keys, overlap_s=60, clock=lambda: 2030.0
    )
    assert book.for_tenant("tenant-a") == tuple(
        signing.Secret.parse(secret_of("tenant-a", g)) for g in (2, 1)
    )
    later = signing.TenantSecrets(
        [SHARED], master=MASTER, redis=redis, keys=keys, overlap_s=60, clock=lambda: 2061.0
    )
    assert later.for_tenant("tenant-a") == (signing.Secret.parse(secret_of("tenant-a", 2)),)


def test_keys_create_shows_the_tenants_webhook_secret_once(redis, setup, receiver, tmp_path) -> None:  # type: ignore[no-untyped-def]
    settings, keys = setup
    # The command in process (Click's runner), its environment replaced for the call: the CLI builds
    # its settings from the environment at each command, as a fresh process would.
    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith("CONVEYOR_")}
    env.update(
        {
            "REDIS_URL": settings.redis_url or "",
            "CONVEYOR_NAMESPACE": settings.namespace,
            "CONVEYOR_HOME": str(tmp_path),
            "CONVEYOR_WEBHOOK_MASTER_KEY": MASTER,
        }
    )

    def conveyor(*args: str) -> Result:
        return CliRunner().invoke(cli, list(args), env=env)

    made = conveyor("keys", "create", "--tenant", "tenant-a")
    assert made.exit_code == 0, made.stderr
    assert made.stdout.strip().startswith("cvk_")  # stdout: the API key alone
    (shown,) = [w for w in made.stderr.split() if w.startswith("whsec_")]
    second = conveyor("keys", "create", "--tenant", "tenant-a")  # another key: the secret stays
    assert "whsec_" not in second.stderr + second.stdout
    deliver(redis, settings, keys, receiver.url(), "tenant-a")
    headers, body = receiver.received[-1]
    Webhook(shown).verify(body, headers)

    rotated = conveyor("keys", "rotate-webhook-secret", "--tenant", "tenant-a")
    assert rotated.exit_code == 0, rotated.stderr
    new = rotated.stdout.strip()
    assert new.startswith("whsec_") and new != shown
    deliver(redis, settings, keys, receiver.url(), "tenant-a")
    headers, body = receiver.received[-1]
    Webhook(new).verify(body, headers)
