"""The receivers docs/webhooks.md shows (docs/examples/webhook_receiver.py and .js), run as a user runs
them and sent deliveries signed by Conveyor's own signing code (app/webhooks/signing.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from app.webhooks import signing

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "docs" / "examples"
PAGE = ROOT / "docs" / "webhooks.md"
NODE = shutil.which("node")


def delivery(
    secrets: list[str], *, body: bytes | None = None, at: int | None = None
) -> tuple[dict[str, str], bytes]:
    """A `job.completed` delivery exactly as the callbacks worker signs it."""
    body = (
        body
        or json.dumps(
            {
                "type": "job.completed",
                "timestamp": "2026-12-03T10:00:00Z",
                "data": {"id": "job-1", "status": "succeeded"},
            }
        ).encode()
    )
    keys = [signing.Secret.parse(s) for s in secrets]
    return signing.headers("msg_job-1_completed", at or int(time.time()), body, keys), body


def load_python_receiver():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("webhook_receiver", EXAMPLES / "webhook_receiver.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_page_shows_the_receivers_as_they_are_tested() -> None:
    page = PAGE.read_text()
    for name in ("webhook_receiver.py", "webhook_receiver.js"):
        assert (EXAMPLES / name).read_text() in page, (
            f"docs/webhooks.md must show docs/examples/{name} verbatim"
        )


def test_the_python_receiver_verifies_a_delivery_and_refuses_a_forgery() -> None:
    verify = load_python_receiver().verify
    secret = signing.generate()
    headers, body = delivery([secret])
    assert verify(secret, headers, body)["data"]["id"] == "job-1"
    with pytest.raises(ValueError, match="no signature"):
        verify(secret, headers, body.replace(b"succeeded", b"failed"))
    with pytest.raises(ValueError, match="no signature"):
        verify(signing.generate(), headers, body)
    with pytest.raises(ValueError, match="timestamp"):
        verify(secret, *delivery([secret], at=int(time.time()) - 600))
    # During a rotation every configured secret signs: a receiver holding either one verifies.
    old, new = signing.generate(), signing.generate()
    headers, body = delivery([old, new])
    assert verify(new, headers, body) and verify(old, headers, body)


def serve(command: list[str], secret: str) -> Iterator[str]:
    from conftest import free_port

    port = free_port()
    env = {**os.environ, "CONVEYOR_WEBHOOK_SECRET": secret, "PORT": str(port)}
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert process.stdout is not None
        assert "listening" in process.stdout.readline()
        yield f"http://127.0.0.1:{port}/hooks/conveyor"
    finally:
        process.terminate()
        process.wait(10)


def receivers() -> list[object]:
    node = pytest.param(
        [NODE or "node", str(EXAMPLES / "webhook_receiver.js")],
        id="node",
        marks=pytest.mark.skipif(NODE is None, reason="node is not installed"),
    )
    return [pytest.param([sys.executable, str(EXAMPLES / "webhook_receiver.py")], id="python"), node]


@pytest.mark.parametrize("command", receivers())
def test_the_receiver_answers_204_to_a_signed_delivery_and_400_to_a_forged_one(command: list[str]) -> None:
    secret = signing.generate()
    for url in serve(command, secret):
        headers, body = delivery([signing.generate(), secret])  # signed by two secrets, one of them its own
        assert httpx.post(url, content=body, headers=headers).status_code == 204
        assert httpx.post(url, content=body, headers=headers).status_code == 204  # a retry: handled once
        forged = httpx.post(url, content=body.replace(b"job-1", b"job-2"), headers=headers)
        assert forged.status_code == 400 and "no signature matches" in forged.text
        unsigned = httpx.post(url, content=body, headers={"content-type": "application/json"})
        assert unsigned.status_code == 400
