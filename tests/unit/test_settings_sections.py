"""The sections of the settings. A component's (`Settings.batcher`, `Settings.admission`, ...) is built
once from the fields, and a copy of the settings derives its own instead of carrying the original's;
a section of settings (`Settings.webhook`, CONVEYOR_WEBHOOK_*) reads its variables as flat ones did."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.core.config import EMBEDDING_MODEL, Settings, unknown_variables
from app.core.sections import SECTIONS


def test_a_copy_derives_its_sections_from_its_own_fields() -> None:
    settings = Settings(stages=1, job_ttl_s=600)
    assert settings.batcher.stages == 1 and settings.lifetimes.ttl_s == 600  # built, and cached
    copied = settings.model_copy(update={"stages": 3, "job_ttl_s": 60, "home": Path("/elsewhere")})
    assert copied.batcher.stages == 3 and copied.batcher.life.ttl_s == 60
    assert copied.lifetimes.ttl_s == 60 and str(copied.model_home) == "/elsewhere/models"
    assert settings.batcher.stages == 1 and settings.batcher is settings.batcher  # the original's stays


def test_admission_derives_its_grace_limits_breaker_and_tenant_shares_once() -> None:
    settings = Settings(
        heartbeat_ttl_s=7.0,
        queue_depth_limit=100,
        tenant_queue_shares={"batch-import": 0.29, "tiny": 0.001},
        job_ttl_s=3600,
        stages=3,
        embedding_stages=2,
    )
    section = settings.admission
    assert section is settings.admission  # built once
    assert section.stage_down_after_s == 14.0  # 2 x heartbeat_ttl_s
    limits = section.limits
    assert (limits.class_depth, limits.overall, limits.retry_after_s) == (100, 200, 2.0)  # overall: 2 x
    breaker = section.breaker
    assert (breaker.error_threshold, breaker.min_requests, breaker.interval_s) == (0.3, 100, 30.0)
    assert section.tenant_queue_limit("anyone") == 50  # the default share, a half
    assert section.tenant_queue_limit("batch-import") == 29  # 0.29 x 100, not 28.999...
    assert section.tenant_queue_limit("tiny") == 1  # at least one job
    assert section.life.ttl_s == 3600
    assert section.stages_of("SmolLM2-135M-Instruct") == 3 and section.stages_of(EMBEDDING_MODEL) == 2


def test_the_catalog_finds_models_as_the_settings_do(tmp_path: Path) -> None:
    (tmp_path / "models" / "added").mkdir(parents=True)
    (tmp_path / "models" / "added" / "config.json").write_text("{}")
    settings = Settings(home=tmp_path, models={"configured": tmp_path / "elsewhere"}, served_models=["added"])
    catalog = settings.catalog
    assert catalog.model_names() == settings.model_names() == ["added", "configured"]
    for name in ("added", "configured", "../added", "missing"):
        assert catalog.model_path(name) == settings.model_path(name)
    assert (
        catalog.model_path("added") == tmp_path / "models" / "added"
        and catalog.model_path("../added") is None
    )
    assert catalog.served_models == ("added",)


def test_the_job_service_carries_the_sections_of_what_it_builds() -> None:
    settings = Settings(
        default_max_tokens=2048,
        max_tokens_limit=1024,
        tenant_priorities={"*": ["normal", "low"], "ops": ["realtime", "high"]},
    )
    section = settings.job_service
    assert section is settings.job_service and section.default_max_tokens == 1024  # within the limit
    assert section.allowed_priorities("anyone") == {"normal", "batch"}  # `low` is `batch`
    assert section.allowed_priorities("ops") == {"realtime", "high"}
    # unset: every class but realtime, which is given by name only
    assert Settings().job_service.allowed_priorities("anyone") == {"high", "normal", "batch"}
    assert section.admission is settings.admission and section.rate_limiter is settings.rate_limiter
    assert section.webhooks is settings.webhook


def test_a_sections_settings_keep_their_variables_and_their_keyword_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CONVEYOR_WEBHOOK_CONCURRENCY", "3")
    monkeypatch.setenv("CONVEYOR_WEBHOOK_SECRETS", '["whsec_a"]')
    monkeypatch.setenv("CONVEYOR_JWT_ALGORITHMS", '["HS256"]')
    monkeypatch.setenv("CONVEYOR_BATCH_FILE_MAX_BYTES", "2048")
    monkeypatch.setenv("CONVEYOR_FLOWER_PORT", "1234")  # nor of `flower`
    settings = Settings()
    assert (settings.webhook.concurrency, settings.webhook.secrets) == (3, ["whsec_a"])
    assert settings.jwt.algorithms == ["HS256"] and settings.batch.tenant_file_bytes == 8 * 2048
    assert settings.flower_port == 1234
    # By keyword as by variable, over what the environment gives the same section.
    given = Settings(webhook_concurrency=9, jwt_key="k", audit_maxlen=70)
    assert (given.webhook.concurrency, given.webhook.secrets, given.jwt.key) == (9, ["whsec_a"], "k")
    assert given.audit.maxlen == 70 and given.authenticator.jwt is given.jwt


def test_no_setting_outside_a_section_is_named_as_one_of_its_variables() -> None:
    """CONVEYOR_WEBHOOK_X is read as `webhook.x`: a setting `webhook_x` beside the section would
    never be read."""
    assert [name for name in Settings.model_fields if name.split("_", 1)[0] in SECTIONS and "_" in name] == []


def test_a_variable_no_setting_reads_is_named_so_that_the_commands_warn_of_it() -> None:
    environ = {
        "CONVEYOR_API_PORT": "1",
        "CONVEYOR_WEBHOOK_CONCURRENCY": "2",  # a section's
        "conveyor_flower_port": "3",  # read whatever its case
        "CONVEYOR_SSE_PING_S": "5",  # a setting since removed
        "CONVEYOR_WEBHOOK_TIMEOUT_S": "5",  # a section's, since removed
        "CONVEYOR_STAGESS": "2",  # a typo
        "REDIS_URL": "redis://x",
        "HOME": "/root",
    }
    assert unknown_variables(environ) == [
        "CONVEYOR_SSE_PING_S",
        "CONVEYOR_STAGESS",
        "CONVEYOR_WEBHOOK_TIMEOUT_S",
    ]
