"""A model is named exactly: an alias of a known model (a trailing slash, `./`, `..`, a doubled slash,
another case) or a path to a model directory is 404 `model_not_found` on every route that takes a
model, and loads nothing: the catalog of tokenizers keeps its size.

The API runs in process (its lifespan included) on the real Redis; no worker is needed, since every
request here is refused before admission.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from tiny import make_tiny_model

from app.api.app import create_app
from app.core.config import Settings
from app.core.registry import add_model
from app.partitions.families import family_for
from tests.tinyapi import tiny_settings

ALIASES = [
    "tiny/",
    "tiny//",
    "//",
    "./tiny",
    "..",
    "../models/added",
    "added/",
    "./added",
    "added/.",
    "models/added",
    "ADDED",
    "added ",
    "added\x00",
    "/",
]


@pytest.fixture(scope="module")
def settings(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Settings:
    root = tmp_path_factory.mktemp("names")
    configured = make_tiny_model(root / "src" / "tiny")
    settings = tiny_settings(
        redis_url,
        configured,
        home=root / "home",
        auth="none",  # an open API: these tests are about names, not credentials
    )
    add_model(
        settings,
        str(make_tiny_model(root / "src" / "added", seed=1)),
        family=lambda c: family_for(c).name,
        echo=lambda _: None,
    )
    return settings


@pytest.fixture(scope="module")
def api(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as client:
        client.app.state.jobs.catalog.get("added")  # type: ignore[attr-defined]
        yield client


def catalog_size(api: TestClient) -> int:
    return len(api.app.state.jobs.catalog)  # type: ignore[attr-defined]


def refused(api: TestClient, model: str) -> list[str]:
    """The error code of each route that takes a model name, for this one."""
    answers = [
        api.post("/v1/jobs", json={"model": model, "prompt": "hi", "max_tokens": 1}),
        api.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 1}),
        api.post(
            "/v1/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
        ),
    ]
    return [f"{a.status_code} {a.json()['error']['code']}" for a in answers]


@pytest.mark.parametrize("alias", ALIASES)
def test_an_alias_is_not_found_and_loads_nothing(api, alias):  # type: ignore[no-untyped-def]
    before = catalog_size(api)
    assert before == 2  # the default model (loaded at start) and the added one
    assert refused(api, alias) == ["404 model_not_found"] * 3
    assert catalog_size(api) == before


def test_an_absolute_path_is_not_found(api, settings):  # type: ignore[no-untyped-def]
    before = catalog_size(api)
    for path in (settings.models["tiny"], settings.model_home / "added", Path("/etc")):
        assert refused(api, str(path)) == ["404 model_not_found"] * 3
    assert catalog_size(api) == before


def test_the_names_themselves_are_known(api, settings):  # type: ignore[no-untyped-def]
    assert settings.model_names() == ["added", "tiny"]
    for alias in [*ALIASES, ""]:  # (an empty name in a request means the default model)
        assert settings.model_path(alias) is None, alias
    assert settings.model_path("added") == settings.model_home / "added"


def test_a_known_model_this_stack_does_not_serve_is_not_found(settings):  # type: ignore[no-untyped-def]
    served = settings.model_copy(update={"served_models": ["tiny"]})
    with TestClient(create_app(served)) as client:
        assert refused(client, "added") == ["404 model_not_found"] * 3
        assert len(client.app.state.jobs.catalog) == 1  # type: ignore[attr-defined]
        message = client.post("/v1/jobs", json={"model": "added", "prompt": "hi"}).json()["error"]["message"]
        assert "available: ['tiny']" in message
