"""`conveyor keys create` says loudly when the API it makes a key for serves open (CONVEYOR_AUTH=none,
as `make run` starts it): the key is stored, but nothing checks it. Each API process records how it
serves in Redis (app/api/authmode.py); the command reads it.

The real API app (its lifespan included) over a real Redis, in process; the command in process too."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from click.testing import Result
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from app.api.app import create_app
from app.api.authmode import RECORD_TTL_S, served_modes
from app.cli import cli
from app.core.keys import Keys
from tests.tinyapi import forget_namespace, tiny_settings

WARNING = "WITHOUT AUTHENTICATION"
RECIPE = "CONVEYOR_AUTH=keys make run"


def keys_create(redis_url: str, namespace: str, home: Path) -> Result:
    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith("CONVEYOR_")}
    env.update({"REDIS_URL": redis_url, "CONVEYOR_NAMESPACE": namespace, "CONVEYOR_HOME": str(home)})
    return CliRunner().invoke(cli, ["keys", "create", "--tenant", "me"], env=env)


@pytest.mark.parametrize("auth", ["none", "keys"])
def test_keys_create_warns_only_when_api_serves_open(redis_url, redis, tiny_model, tmp_path, auth) -> None:  # type: ignore[no-untyped-def]
    settings = tiny_settings(redis_url, tiny_model, auth=auth)
    try:
        with TestClient(create_app(settings)):
            made = keys_create(redis_url, settings.namespace, tmp_path)
            assert made.exit_code == 0, made.stderr
            assert made.stdout.strip().startswith("cvk_")  # stdout: the key alone, warning or not
            if auth == "none":
                assert WARNING in made.stderr and RECIPE in made.stderr
                assert "does not check this key" in made.stderr
            else:
                assert WARNING not in made.stderr and "no API" not in made.stderr
        # The API stopped: it took its record back, so the command says no API runs (and how to start one).
        assert served_modes(redis, Keys(settings.namespace)) == set()
        after = keys_create(redis_url, settings.namespace, tmp_path)
        assert after.exit_code == 0 and WARNING not in after.stderr
        assert "no API of this stack is running" in after.stderr and RECIPE in after.stderr
    finally:
        forget_namespace(redis_url, settings.namespace)


def test_a_record_expires_with_the_api_that_made_it(redis_url, redis, tiny_model) -> None:  # type: ignore[no-untyped-def]
    """An API killed without taking its record back stops counting after RECORD_TTL_S, and the key
    carries a TTL (every key expires)."""
    settings = tiny_settings(redis_url, tiny_model, auth="none")
    keys = Keys(settings.namespace)
    try:
        with TestClient(create_app(settings)):
            assert served_modes(redis, keys) == {"none"}
            assert 0 < redis.ttl(keys.api_auth()) <= RECORD_TTL_S
            assert served_modes(redis, keys, now=time.time() + RECORD_TTL_S + 1) == set()
    finally:
        forget_namespace(redis_url, settings.namespace)
