"""How a non-streamed OpenAI request whose job ended without a completion is answered."""

from __future__ import annotations

from app.api.routes.openai import JobCancelled, JobExpired, error_type


def test_an_expired_job_is_a_429_with_retry_after_as_every_429_is() -> None:
    refusal = JobExpired("job j ended expired", retry_after_s=2.0, job_id="j")
    assert refusal.status == 429 and refusal.code == "expired"
    assert refusal.headers() == {"Retry-After": "2"}
    assert refusal.body()["error"]["details"] == {"job_id": "j", "retry_after_s": 2}
    assert error_type(refusal.status) == "rate_limit_error"


def test_a_cancelled_job_is_a_409_without_retry_after() -> None:
    assert JobCancelled("job j ended cancelled").status == 409
    assert JobCancelled("job j ended cancelled").headers() == {}
