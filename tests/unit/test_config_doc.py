"""docs/configuration.md is generated from `Settings`: the committed page must equal the generator's
output (after adding or changing a setting, run `conveyor docs config --out docs/configuration.md`)."""

from __future__ import annotations

from pathlib import Path

from app.core.config import Settings
from app.core.config_doc import render, rows
from app.core.sections import SECTIONS

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_the_committed_page_is_what_the_generator_makes() -> None:
    assert PAGE.read_text() == render(), (
        "run `conveyor docs config --out docs/configuration.md` and commit it"
    )


def test_every_setting_has_a_row_with_its_variable_and_a_reason() -> None:
    table = {r.env: r for r in rows()}
    sections = sum(len(model.model_fields) for model in SECTIONS.values())
    assert len(table) == len(Settings.model_fields) - len(SECTIONS) + sections
    assert table["CONVEYOR_WEBHOOK_CONCURRENCY"].default == "`8`"  # a section's, by its variable
    assert "REDIS_URL" in table  # the one alias
    assert table["CONVEYOR_EMBEDDED_REDIS_PORT"].default == "`6390`"
    assert table["CONVEYOR_ALLOWED_HOSTS"].default.startswith('`["localhost"')
    assert table["CONVEYOR_JWT_KEY"].default == "unset"
    unexplained = [r.env for r in rows() if not r.description]
    assert not unexplained, f"write why beside these settings in app/core/config.py: {unexplained}"


def test_a_comment_above_and_beside_a_field_both_describe_it() -> None:
    row = next(r for r in rows() if r.env == "CONVEYOR_MAX_BATCH_SIZE")
    assert "stops gaining" in row.description
    assert next(r for r in rows() if r.env == "CONVEYOR_MAX_WAIT_MS").description.startswith(
        "the batching window"
    )
