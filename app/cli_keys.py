"""`conveyor keys`: API keys (stored hashed in Redis, each naming a tenant) and tenants' webhook
signing secrets."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Annotated

import typer

from app.cli_common import keys_redis, load_settings, master_key_file
from app.core.config import Settings

if TYPE_CHECKING:
    import redis

    from app.core.keys import Keys

keys_cli = typer.Typer(help="API keys (stored hashed in Redis, each naming a tenant).", no_args_is_help=True)


@keys_cli.command("create")
def keys_create(
    tenant: Annotated[str, typer.Option(help="The tenant the key acts for.")],
    store: Annotated[
        bool, typer.Option(help="Store its hash in Redis; --no-store prints a CONVEYOR_API_KEYS entry.")
    ] = True,
    rotate_webhook_secret: Annotated[
        bool,
        typer.Option(help="Also give the tenant a new webhook signing secret (it gets one if it has none)."),
    ] = False,
) -> None:
    """Make an API key for a tenant and print it (once: only its SHA-256 is kept). A tenant's first key
    also makes its webhook signing secret, printed once on stderr."""
    from app.api.auth import checked_tenant, key_digest, new_api_key
    from app.core.errors import Unauthorized

    try:
        checked_tenant(tenant)
    except Unauthorized as exc:
        raise typer.BadParameter(exc.message) from exc
    key = new_api_key()
    digest = key_digest(key)
    if store:
        settings = load_settings()
        client, keys = keys_redis(settings)
        record = json.dumps({"tenant": tenant, "created_at": time.time()})
        client.hset(keys.api_keys(), digest, record)
        _tenant_webhook_secret(settings, client, keys, tenant, rotate=rotate_webhook_secret, out_err=True)
        _say_who_checks_keys(client, keys)
        typer.echo(
            f"stored for tenant {tenant!r} (sha256 {digest[:12]}...); the key, shown only now:", err=True
        )
    else:
        typer.echo(f'add to CONVEYOR_API_KEYS: {{"{digest}": "{tenant}"}}; the key:', err=True)
    typer.echo(key)


OPEN_API_WARNING = """\
!!! WARNING: the API of this stack serves WITHOUT AUTHENTICATION (CONVEYOR_AUTH=none, as `make run`
!!! starts it): it does not check this key, and anyone who reaches it is tenant 'anonymous'.
!!! The key is stored and kept. To require keys, stop the stack and start it again with
!!! `CONVEYOR_AUTH=keys make run` (or `CONVEYOR_AUTH=keys conveyor up`)."""


def _say_who_checks_keys(client: redis.Redis, keys: Keys) -> None:
    """After a key is stored: warn, loudly, when an API of this stack serves open (the key would change
    nothing), and say what starts one that checks it when no API is running."""
    from app.api.authmode import served_modes

    modes = served_modes(client, keys)
    if "none" in modes:
        typer.secho(OPEN_API_WARNING, err=True, fg=typer.colors.RED, bold=True)
    elif not modes:
        typer.echo(
            "no API of this stack is running: start it with CONVEYOR_AUTH=keys (`CONVEYOR_AUTH=keys make "
            "run`) to require keys",
            err=True,
        )


@keys_cli.command("rotate-webhook-secret")
def keys_rotate_webhook_secret(
    tenant: Annotated[str, typer.Option(help="The tenant whose webhook signing secret changes.")],
) -> None:
    """Give a tenant a new webhook signing secret (its first, if it had none) and print it, once. The
    previous one keeps signing too for a day (webhooks.signing.SECRET_OVERLAP_S)."""
    from app.api.auth import checked_tenant
    from app.core.errors import Unauthorized

    try:
        checked_tenant(tenant)
    except Unauthorized as exc:
        raise typer.BadParameter(exc.message) from exc
    settings = load_settings()
    client, keys = keys_redis(settings)
    if not _tenant_webhook_secret(settings, client, keys, tenant, rotate=True, out_err=False):
        raise typer.Exit(1)


def _tenant_webhook_secret(
    settings: Settings, client: redis.Redis, keys: Keys, tenant: str, *, rotate: bool, out_err: bool
) -> bool:
    """Make the tenant's own webhook secret when it has none (or `rotate`) and print it, once: on stderr
    beside `keys create` (whose stdout is the API key alone), on stdout for `rotate-webhook-secret`.
    False when no master key is known (the tenant stays on the shared secret)."""
    from app.webhooks import signing

    master = settings.webhook.master_key
    if not master and master_key_file(settings).exists():  # the one `conveyor up` made
        master = master_key_file(settings).read_text().strip()
    if not master:
        typer.echo(
            "no webhook master key (CONVEYOR_WEBHOOK_MASTER_KEY): this tenant's webhooks are signed "
            "with the shared secret (CONVEYOR_WEBHOOK_SECRETS)",
            err=True,
        )
        return False
    if not rotate and signing.generation(client, keys, tenant) is not None:
        typer.echo(f"tenant {tenant!r} keeps its webhook signing secret", err=True)
        return True
    generation = signing.rotate(client, keys, tenant)
    secret = signing.encode(signing.derive(signing.Secret.parse(master), tenant, generation))
    typer.echo(
        f"webhook signing secret of tenant {tenant!r} (generation {generation}), shown only now:", err=True
    )
    typer.echo(secret, err=out_err)
    return True


@keys_cli.command("revoke")
def keys_revoke(key: Annotated[str, typer.Argument(help="The API key, or its SHA-256 hex.")]) -> None:
    """Remove an API key from Redis: requests with it are refused from now on."""
    from app.api.auth import key_digest

    digest = key if len(key) == 64 and all(c in "0123456789abcdef" for c in key) else key_digest(key)
    client, keys = keys_redis(load_settings())
    if not client.hdel(keys.api_keys(), digest):
        typer.echo("no such key", err=True)
        raise typer.Exit(1)
    typer.echo(f"revoked {digest[:12]}...")
