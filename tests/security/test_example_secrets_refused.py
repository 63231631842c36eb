"""The secrets the repository once published as examples (the Kubernetes base's API key, HS256 JWT
secret, webhook secret and Flower password; docker-compose's webhook secret) stop every process that
holds one, at start, with a message naming the setting: the api (`create_app`, `conveyor api`), the
callbacks worker and `conveyor up`. Real ones start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.api.app import create_app
from app.core.config import Settings
from app.core.known_secrets import KnownSecret, known_secrets_in_use
from app.webhooks.signing import generate

ROOT = Path(__file__).resolve().parents[2]
PUBLISHED = {
    "api_keys": {"22a60ff8c666ee7f81ede927b1adfb38922412b0bbd7162b99525a22607f603b": "example"},
    "jwt_key": "example-jwt-secret-change-me-at-least-32-bytes",
    "webhook_secrets": ["whsec_ZXhhbXBsZS13ZWJob29rLXNlY3JldC1jaGFuZ2UtbWU="],
    "flower_basic_auth": "admin:change-me",
}


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("api_keys", PUBLISHED["api_keys"], "CONVEYOR_API_KEYS"),
        ("jwt_key", PUBLISHED["jwt_key"], "CONVEYOR_JWT_KEY"),
        ("webhook_secrets", PUBLISHED["webhook_secrets"], "CONVEYOR_WEBHOOK_SECRETS"),
        ("webhook_secrets", ["whsec_ZGV2ZWxvcG1lbnQtb25seS1jb21wb3NlLXNlY3JldA"], "CONVEYOR_WEBHOOK_SECRETS"),
        ("flower_basic_auth", "ops:real-one,admin:change-me", "CONVEYOR_FLOWER_BASIC_AUTH"),
        ("redis_url", "redis://:change-me@redis:6379/0", "REDIS_URL"),
    ],
)
def test_the_api_refuses_to_start_with_a_published_example(field: str, value: object, named: str) -> None:
    settings = Settings(jwt_algorithms=["HS256"], **{field: value})  # type: ignore[arg-type]
    with pytest.raises(KnownSecret, match=named) as refused:
        create_app(settings)
    assert "example" in str(refused.value)


def test_real_secrets_start() -> None:
    settings = Settings(
        api_keys={"ab" * 32: "tenant"},
        jwt_key=os.urandom(32).hex(),
        jwt_algorithms=["HS256"],
        webhook_secrets=[generate()],
        webhook_master_key=generate(),
        flower_basic_auth="admin:" + os.urandom(16).hex(),
        redis_url="redis://:" + os.urandom(16).hex() + "@redis:6379/0",
    )
    assert known_secrets_in_use(settings) == []
    create_app(settings)


@pytest.mark.parametrize("command", [["up"], ["api"], ["webhooks", "worker"]])
def test_processes_exit_with_a_clear_message(command: list[str], tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_") and k != "REDIS_URL"}
    env.update(
        {
            "CONVEYOR_HOME": str(tmp_path),
            "CONVEYOR_JWT_KEY": PUBLISHED["jwt_key"],
            "CONVEYOR_JWT_ALGORITHMS": '["HS256"]',
            "CONVEYOR_WEBHOOK_SECRETS": json.dumps(PUBLISHED["webhook_secrets"]),
        }
    )
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", *command],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "CONVEYOR_JWT_KEY" in done.stderr and "CONVEYOR_WEBHOOK_SECRETS" in done.stderr
    assert "Traceback" not in done.stderr
