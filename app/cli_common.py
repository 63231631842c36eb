"""What the `conveyor` commands share: their settings, logging, the refusal of known secrets, the
Redis of API keys and where `conveyor up` keeps the webhook master key."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from app.core.config import Settings, unknown_variables

if TYPE_CHECKING:
    import redis

    from app.core.keys import Keys

SslCertfile = Annotated[
    Path | None, typer.Option("--ssl-certfile", help="Serve the API over HTTPS with this PEM certificate.")
]
SslKeyfile = Annotated[Path | None, typer.Option("--ssl-keyfile", help="The certificate's PEM private key.")]


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stdout
    )


def load_settings(**overrides: object) -> Settings:
    for name in unknown_variables():
        logging.getLogger("conveyor").warning(
            "%s is not a setting (a typo, or a setting since removed: see CHANGELOG.md); ignored", name
        )
    settings = Settings()
    return settings.model_copy(update={k: v for k, v in overrides.items() if v is not None})


def exit_on_known_secrets(settings: Settings) -> None:
    from app.core.known_secrets import KnownSecret, refuse_known_secrets

    try:
        refuse_known_secrets(settings)
    except KnownSecret as exc:
        typer.echo(f"conveyor: {exc}", err=True)
        raise typer.Exit(2) from exc


def master_key_file(settings: Settings) -> Path:
    return settings.home / "webhook_master_key"


def keys_redis(settings: Settings) -> tuple[redis.Redis, Keys]:
    """The Redis the API reads keys from: REDIS_URL, else the embedded one (`conveyor up` running; its
    password is in the home)."""
    from app.core.keys import Keys
    from app.core.redis import embedded_url, password_file, sync_client

    url = settings.redis_url
    if not url:
        secret = password_file(settings.home)
        if not secret.exists():
            raise typer.BadParameter(
                f"REDIS_URL is unset and {secret} does not exist: start `conveyor up` first"
            )
        url = embedded_url("127.0.0.1", settings.embedded_redis_port, secret.read_text().strip())
    return sync_client(url), Keys(settings.namespace)
