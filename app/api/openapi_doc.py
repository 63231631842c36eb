"""The API's OpenAPI document as committed in docs/openapi.json.

`conveyor docs openapi` writes it; tests/unit/test_openapi_doc.py checks that the committed file
equals `create_app(...).openapi()`, so the published reference cannot drift from the routes.
"""

from __future__ import annotations

import json

from app.api.app import create_app
from app.core.config import Settings


def openapi_document() -> str:
    """The schema of an app built from the defaults alone (never the environment), as JSON text."""
    app = create_app(Settings.model_construct())
    return json.dumps(app.openapi(), indent=2, ensure_ascii=False) + "\n"
