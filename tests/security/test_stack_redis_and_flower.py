"""What `conveyor up` starts is never open to whoever reaches it.

- a REDIS_URL without a password that points beyond this host is refused before anything starts
  (whoever reaches that Redis can add API keys and read every prompt), unless
  CONVEYOR_ALLOW_PASSWORDLESS_REDIS says it is protected otherwise; loopback and Unix sockets pass;
- Flower always asks for a login (CONVEYOR_FLOWER_BASIC_AUTH, else one made under the home, owner
  only), and neither its login nor the broker URL is on its command line (`ps` shows it to every local
  user): a real Flower started as `up` starts it answers 401 without them.
"""

from __future__ import annotations

import base64
import os
import stat
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from conftest import ROOT, free_port
from typer.testing import CliRunner

from app import cli_up
from app.cli import cli
from app.core.config import Settings
from app.stack import flower_child, flower_login, passwordless_remote_redis


@pytest.mark.parametrize(
    ("url", "open_"),
    [
        ("redis://10.0.0.5:6379/0", True),
        ("redis://redis.internal:6379/0", True),
        ("rediss://cache.example.com:6380/0", True),
        ("redis://default@10.0.0.5:6379/0", True),  # a user, no password
        ("redis://[fd00::5]:6379/0", True),
        ("redis://:s3cret@10.0.0.5:6379/0", False),
        ("redis://app:s3cret@10.0.0.5:6379/0", False),
        ("redis://10.0.0.5:6379/0?password=s3cret", False),
        ("redis://127.0.0.1:6379/0", False),
        ("redis://127.5.6.7:6379/0", False),
        ("redis://localhost:6379/0", False),
        ("redis://[::1]:6379/0", False),
        ("unix:///run/redis.sock", False),
    ],
)
def test_which_redis_urls_are_open_beyond_this_host(url: str, open_: bool) -> None:
    assert passwordless_remote_redis(url) is open_


def up(tmp_path: Path, redis_url: str, **env: str) -> str:
    result = CliRunner().invoke(
        cli,
        ["up", "--only", "batcher"],
        env={"CONVEYOR_HOME": str(tmp_path), "REDIS_URL": redis_url, "COLUMNS": "300", **env},
    )
    assert result.exit_code == 2, result.output
    return " ".join(result.output.split())


def test_up_refuses_a_remote_redis_without_a_password(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cli_up, "REDIS_WAIT_S", 0.5)  # none answers where the allowed ones go on to look
    said = up(tmp_path, "redis://192.0.2.10:6379/0")
    assert "without a password" in said and "CONVEYOR_ALLOW_PASSWORDLESS_REDIS" in said
    # allowed explicitly, or with a password, it goes on to look for the server (none answers there)
    allowed = up(tmp_path, "redis://0.0.0.0:1/0", CONVEYOR_ALLOW_PASSWORDLESS_REDIS="true")
    with_password = up(tmp_path, "redis://:s3cret@127.0.0.1:1/0")
    assert "without a password" not in allowed + with_password and "no Redis answers" in with_password


def test_flower_gets_a_login_made_once_and_owner_only(tmp_path: Path) -> None:
    said: list[str] = []
    settings = Settings(home=tmp_path / "home")
    login = flower_login(settings, said.append)
    user, _, password = login.partition(":")
    path = tmp_path / "home" / "flower_password"
    assert user == "conveyor" and len(password) >= 32 and path.read_text().strip() == password
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and password not in " ".join(said)
    assert flower_login(settings, said.append) == login  # kept across restarts
    assert flower_login(settings.model_copy(update={"flower_basic_auth": "ops:x"}), said.append) == "ops:x"


def test_flower_runs_behind_its_login_with_nothing_secret_on_its_command_line(
    tmp_path: Path, redis_url: str
) -> None:
    settings = Settings(flower_port=free_port())
    broker = redis_url.replace("/0", "/15")
    child = flower_child(settings, broker, "ops:flower-test-password")
    assert "flower-test-password" not in " ".join(child.argv) and broker not in " ".join(child.argv)
    process = subprocess.Popen(
        child.argv,
        cwd=ROOT,
        env={**os.environ, **child.env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{settings.flower_port}/api/workers"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                anonymous = httpx.get(url, timeout=2)
                break
            except httpx.TransportError:
                assert process.poll() is None and time.monotonic() < deadline, "Flower did not start"
                time.sleep(0.2)
        assert anonymous.status_code == 401
        token = base64.b64encode(b"ops:flower-test-password").decode()
        assert httpx.get(url, headers={"Authorization": f"Basic {token}"}, timeout=10).status_code == 200
    finally:
        process.terminate()
        process.wait(timeout=10)
