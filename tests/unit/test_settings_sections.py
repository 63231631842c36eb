"""The sections of the settings (`Settings.batcher`, `Settings.webhooks`, ...): each is built once from
the flat fields, and a copy of the settings derives its own instead of carrying the original's."""

from __future__ import annotations

from pathlib import Path

from app.core.config import Settings


def test_a_copy_derives_its_sections_from_its_own_fields() -> None:
    settings = Settings(stages=1, job_ttl_s=600)
    assert settings.batcher.stages == 1 and settings.webhooks.job_ttl_s == 600  # built, and cached
    copied = settings.model_copy(update={"stages": 3, "job_ttl_s": 60, "home": Path("/elsewhere")})
    assert copied.batcher.stages == 3 and copied.batcher.life.ttl_s == 60
    assert copied.webhooks.job_ttl_s == 60 and str(copied.model_home) == "/elsewhere/models"
    assert settings.batcher.stages == 1 and settings.batcher is settings.batcher  # the original's stays
