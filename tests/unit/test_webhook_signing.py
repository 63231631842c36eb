"""Our Standard Webhooks signatures, checked by the spec's reference library (`standardwebhooks`)."""

from __future__ import annotations

import base64
import json
import stat
import time

import pytest
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from app.webhooks import signing
from app.webhooks.signing import Secret, SecretBook

SECRET = "whsec_" + base64.b64encode(b"k" * 32).decode()
OLD_SECRET = "whsec_" + base64.b64encode(b"o" * 32).decode()
OTHER = "whsec_" + base64.b64encode(b"x" * 32).decode()
BODY = json.dumps(
    {"type": "job.completed", "timestamp": "2026-01-01T00:00:00.000+00:00", "data": {"id": "j"}}
)


def signed(*secrets: str, timestamp: int | None = None, body: str = BODY) -> dict[str, str]:
    keys = [Secret.parse(s) for s in secrets]
    return signing.headers("msg_j_completed", timestamp or int(time.time()), body.encode(), keys)


def test_a_delivery_verifies_with_the_reference_library() -> None:
    headers = signed(SECRET)
    assert Webhook(SECRET).verify(BODY, headers) == json.loads(BODY)
    assert headers["webhook-signature"].startswith("v1,")
    assert headers["webhook-id"] == "msg_j_completed"


def test_a_changed_body_fails() -> None:
    headers = signed(SECRET)
    with pytest.raises(WebhookVerificationError):
        Webhook(SECRET).verify(BODY.replace('"j"', '"k"'), headers)


def test_a_wrong_secret_fails() -> None:
    with pytest.raises(WebhookVerificationError):
        Webhook(OTHER).verify(BODY, signed(SECRET))


@pytest.mark.parametrize("offset_s", [-301, 301, -3600])
def test_a_timestamp_more_than_five_minutes_off_fails(offset_s: int) -> None:
    headers = signed(SECRET, timestamp=int(time.time()) + offset_s)  # a valid signature, but stale
    with pytest.raises(WebhookVerificationError, match="too (old|new)"):
        Webhook(SECRET).verify(BODY, headers)


def test_a_timestamp_within_five_minutes_verifies() -> None:
    Webhook(SECRET).verify(BODY, signed(SECRET, timestamp=int(time.time()) - 240))


def test_a_moved_timestamp_breaks_the_signature() -> None:
    headers = signed(SECRET)
    headers["webhook-timestamp"] = str(int(headers["webhook-timestamp"]) - 10)
    with pytest.raises(WebhookVerificationError, match="signature"):
        Webhook(SECRET).verify(BODY, headers)


def test_during_a_rotation_every_active_secret_signs() -> None:
    headers = signed(SECRET, OLD_SECRET)
    assert len(headers["webhook-signature"].split(" ")) == 2
    Webhook(SECRET).verify(BODY, headers)  # a receiver on the new secret
    Webhook(OLD_SECRET).verify(BODY, headers)  # and one not yet moved
    with pytest.raises(WebhookVerificationError):
        Webhook(OTHER).verify(BODY, headers)


def test_the_signature_is_hmac_sha256_of_id_timestamp_body() -> None:
    import hashlib
    import hmac

    expected = hmac.new(b"k" * 32, f"msg_1.1700000000.{BODY}".encode(), hashlib.sha256).digest()
    assert Secret.parse(SECRET).sign("msg_1", 1700000000, BODY.encode()) == (
        "v1," + base64.b64encode(expected).decode()
    )


def test_secrets_parse_with_or_without_prefix_and_padding() -> None:
    raw = base64.b64encode(b"abcde").decode()  # "YWJjZGU=": padded
    assert Secret.parse("whsec_" + raw).key == b"abcde"
    assert Secret.parse(raw.rstrip("=")).key == b"abcde"
    for bad in ("whsec_", "whsec_not base64!", ""):
        with pytest.raises(ValueError):
            Secret.parse(bad)


def test_a_generated_secret_is_usable_by_the_reference_library() -> None:
    secret = signing.generate()
    assert secret.startswith("whsec_") and len(Secret.parse(secret).key) == 32
    Webhook(secret).verify(BODY, signed(secret))


def test_no_secret_cannot_sign() -> None:
    with pytest.raises(ValueError):
        signing.headers("msg_1", 1, b"{}", [])


def test_secret_lookup_falls_back_to_the_default_list_per_tenant() -> None:
    book = SecretBook([SECRET, OLD_SECRET], by_tenant={"acme": [OTHER]})
    assert (
        book.for_tenant(None)
        == book.for_tenant("unknown")
        == (Secret.parse(SECRET), Secret.parse(OLD_SECRET))
    )
    assert book.for_tenant("acme") == (Secret.parse(OTHER),)


def test_the_secret_file_is_made_once_and_private(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "home" / "webhook_secret"
    first = signing.ensure_secret_file(path)
    assert signing.ensure_secret_file(path) == first
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    Secret.parse(first)
