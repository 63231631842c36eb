"""docs/openapi.json is the API's own schema: the committed file must equal `create_app().openapi()`
(after changing a route, run `conveyor docs openapi --out docs/openapi.json`)."""

from __future__ import annotations

import json
from pathlib import Path

from app.api.app import create_app
from app.api.openapi_doc import openapi_document
from app.core.config import Settings

DOC = Path(__file__).resolve().parents[2] / "docs" / "openapi.json"


def test_the_committed_document_is_the_apps_schema() -> None:
    committed = json.loads(DOC.read_text())
    assert committed == create_app(Settings.model_construct()).openapi(), (
        "run `conveyor docs openapi --out docs/openapi.json` and commit it"
    )
    assert DOC.read_text() == openapi_document()


def test_the_document_names_the_main_routes() -> None:
    paths = json.loads(DOC.read_text())["paths"]
    for path in (
        "/v1/jobs",
        "/v1/jobs/{job_id}",
        "/v1/jobs/{job_id}/events",
        "/v1/chat/completions",
        "/readyz",
    ):
        assert path in paths
