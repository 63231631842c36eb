"""The playground page keeps to itself: only its own inline script runs, it talks only to its origin,
and no other site may frame it (the API starts open on a laptop). The page working under this policy
in a real browser is tests/e2e/test_playground.py's part."""

from __future__ import annotations

import base64
import hashlib
import re

from fastapi import FastAPI
from fastapi.testclient import TestClient

from app.api.routes import playground


def test_the_playground_is_served_with_a_policy_that_runs_only_its_own_script() -> None:
    app = FastAPI()
    app.include_router(playground.router)
    answer = TestClient(app).get("/playground")
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/html")
    policy = dict(part.strip().split(" ", 1) for part in answer.headers["content-security-policy"].split(";"))
    (script,) = re.findall(rb"<script>(.*?)</script>", answer.content, re.S)
    digest = base64.b64encode(hashlib.sha256(script).digest()).decode()
    assert policy["script-src"] == f"'sha256-{digest}'"  # no 'unsafe-inline': an injected script does not run
    assert policy["default-src"] == "'none'" and policy["connect-src"] == "'self'"
    assert policy["frame-ancestors"] == "'none'" and policy["base-uri"] == "'none'"
    assert answer.headers["x-frame-options"] == "DENY"
    assert answer.headers["x-content-type-options"] == "nosniff"
    assert answer.headers["referrer-policy"] == "no-referrer"
