"""The routing policy (app/core/routing.py), pure: which model a request for a route goes to, and why."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from app.core.config import RoutePolicy, Settings
from app.core.routing import (
    AUTO,
    SCORED_CHARS,
    PipelineState,
    Reason,
    Route,
    RouteConfigError,
    choose,
    complexity,
    features,
    resolve,
)

SMALL, LARGE = "SmolLM2-135M-Instruct", "gemma-3-270m"
ROUTE = Route(AUTO, SMALL, LARGE, RoutePolicy())
UP = PipelineState(up=True, predicted_wait_s=None)
DOWN = PipelineState(up=False, predicted_wait_s=None)
BOTH_UP = {SMALL: UP, LARGE: UP}


def pick(prompt: str, *, max_tokens: int = 32, state: dict[str, PipelineState] = BOTH_UP, **kw: object):  # type: ignore[no-untyped-def]
    return choose(ROUTE, features(prompt, max_tokens=max_tokens, **kw), state)  # type: ignore[arg-type]


def test_a_short_plain_prompt_goes_to_the_small_model() -> None:
    assert pick("What is the capital of France?") == (SMALL, Reason.SIMPLE)


def test_a_long_prompt_goes_to_the_large_model() -> None:
    long = "Tell me about the sea. " * 100  # plain, but 2,300 characters
    assert complexity(long) <= ROUTE.policy.max_complexity
    assert pick(long) == (LARGE, Reason.PROMPT_LENGTH)


def test_a_large_max_tokens_goes_to_the_large_model() -> None:
    assert pick("Tell me a story.", max_tokens=ROUTE.policy.max_tokens + 1) == (LARGE, Reason.MAX_TOKENS)
    assert pick("Tell me a story.", max_tokens=ROUTE.policy.max_tokens).model == SMALL


@pytest.mark.parametrize(
    "prompt",
    [
        "Explain step by step why the sum of two odd numbers is even, and prove it.",
        "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\nWhat does this compute?",
        "Compare the trade-offs of Redis Streams and Kafka for a job queue, and justify a choice.",
        "Solve 3x + 5 = 20.",
    ],
)
def test_a_complex_prompt_goes_to_the_large_model(prompt: str) -> None:
    assert pick(prompt) == (LARGE, Reason.COMPLEXITY)


@pytest.mark.parametrize(
    "prompt", ["What is the capital of France?", "Name three primary colours.", "Why is the sky blue?"]
)
def test_plain_questions_score_under_the_threshold(prompt: str) -> None:
    assert complexity(prompt) <= RoutePolicy().max_complexity


def test_the_score_is_bounded_and_reads_only_the_first_8_kb() -> None:
    assert complexity("") == 0.0
    worst = "Why? Explain, prove, derive. def f(): return {x == 1}; " * 50 + "1+2=3 " * 50
    assert 0.8 <= complexity(worst) <= 1.0
    assert complexity("a" * SCORED_CHARS + " why explain prove def class return {}") == complexity("a" * 8192)


def test_fallback_to_the_other_model_when_the_chosen_pipeline_is_down() -> None:
    assert pick("Hi there.", state={SMALL: DOWN, LARGE: UP}) == (LARGE, Reason.FALLBACK_DOWN)
    assert pick("Prove it step by step.", state={SMALL: UP, LARGE: DOWN}) == (SMALL, Reason.FALLBACK_DOWN)


def test_when_both_pipelines_are_down_the_policy_stands() -> None:
    # admission then answers as it would for that model (503 stage_unavailable after its grace)
    assert pick("Hi there.", state={SMALL: DOWN, LARGE: DOWN}) == (SMALL, Reason.SIMPLE)


def test_fallback_when_the_chosen_queue_predicts_a_missed_deadline() -> None:
    slow = PipelineState(up=True, predicted_wait_s=45.0)
    quick = PipelineState(up=True, predicted_wait_s=2.0)
    assert pick("Hi there.", state={SMALL: slow, LARGE: quick}) == (LARGE, Reason.FALLBACK_DEADLINE)
    # an unknown wait (nothing finished lately: idle) counts as shorter
    assert pick("Hi there.", state={SMALL: slow, LARGE: UP}) == (LARGE, Reason.FALLBACK_DEADLINE)
    # the job's own timeout_s is its deadline: 60 s leaves 45 s of queue acceptable
    assert pick("Hi there.", state={SMALL: slow, LARGE: quick}, timeout_s=60.0) == (SMALL, Reason.SIMPLE)
    # the other is worse, or down: stay
    worse = PipelineState(up=True, predicted_wait_s=90.0)
    assert pick("Hi there.", state={SMALL: slow, LARGE: worse}) == (SMALL, Reason.SIMPLE)
    assert pick("Hi there.", state={SMALL: slow, LARGE: DOWN}) == (SMALL, Reason.SIMPLE)


def test_a_chat_avoids_a_model_without_a_chat_template() -> None:
    base = PipelineState(up=True, predicted_wait_s=None, chat=False)
    hard = "Explain step by step why the sum of two odd numbers is even."
    assert pick(hard, state={SMALL: UP, LARGE: base}, chat=True) == (SMALL, Reason.FALLBACK_CHAT)
    assert pick(hard, state={SMALL: UP, LARGE: base}) == (LARGE, Reason.COMPLEXITY)  # a prompt is fine
    # a chat is not sent to a model that would refuse it, even when its preferred model is down
    assert pick("Hi.", state={SMALL: DOWN, LARGE: base}, chat=True) == (SMALL, Reason.SIMPLE)


def test_auto_exists_over_two_served_models_smallest_and_largest() -> None:
    sizes = {"a": 270, "b": 135, "c": 1000}
    routes = resolve({}, ["a", "b", "c"], sizes)
    assert list(routes) == [AUTO] and (routes[AUTO].small, routes[AUTO].large) == ("b", "c")
    assert resolve({}, ["a"], sizes) == {}
    # unknown sizes: the order served
    assert (resolve({}, ["x", "y"], {})[AUTO].small, resolve({}, ["x", "y"], {})[AUTO].large) == ("x", "y")


def test_configured_routes_and_thresholds() -> None:
    policy = RoutePolicy(small="b", max_prompt_chars=10, deadline_s=5)
    routes = resolve(
        {"fast": policy, AUTO: RoutePolicy(large="a")}, ["a", "b", "c"], {"a": 2, "b": 1, "c": 3}
    )
    assert (routes["fast"].small, routes["fast"].large, routes["fast"].policy.max_prompt_chars) == (
        "b",
        "c",
        10,
    )
    assert (routes[AUTO].small, routes[AUTO].large) == ("b", "a")


@pytest.mark.parametrize(
    ("configured", "served", "message"),
    [
        (
            {"fast": RoutePolicy(small="nope")},
            ["a", "b"],
            "route 'fast' names model 'nope', which is not served",
        ),
        ({"fast": RoutePolicy()}, ["a"], "route 'fast' needs two served models"),
        ({"a": RoutePolicy()}, ["a", "b"], "route 'a' has the name of a served model"),
    ],
)
def test_route_config_errors_are_clear(
    configured: dict[str, RoutePolicy], served: list[str], message: str
) -> None:
    with pytest.raises(RouteConfigError, match=message):
        resolve(configured, served, {})


def test_route_settings_are_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVEYOR_ROUTES", '{"fast": {"small": "a", "large": "b", "max_tokens": 64}}')
    assert Settings().routes["fast"] == RoutePolicy(small="a", large="b", max_tokens=64)
    monkeypatch.delenv("CONVEYOR_ROUTES")
    with pytest.raises(ValidationError, match="small and large are both 'a'"):
        Settings(routes={"fast": {"small": "a", "large": "a"}})  # type: ignore[dict-item]
    with pytest.raises(ValidationError, match="max_complexity"):
        Settings(routes={"fast": {"max_complexity": 2}})  # type: ignore[dict-item]
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        Settings(routes={"fast": {"max_prompt_tokens": 2}})  # type: ignore[dict-item]
    with pytest.raises(ValidationError, match="cannot name a route"):
        Settings(routes={"../x": {}})  # type: ignore[dict-item]
    with pytest.raises(ValidationError, match="already the name of a model"):
        Settings(models={"tiny": "/m"}, routes={"tiny": {}})  # type: ignore[dict-item]


def test_auto_orders_the_served_models_by_their_parameters(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tiny import make_tiny_model

    from app.api.catalog import Catalog, parameter_count

    big = make_tiny_model(tmp_path / "big", layers=4)
    little = make_tiny_model(tmp_path / "little", layers=1)
    assert parameter_count(big) > parameter_count(little) > 0 and parameter_count(tmp_path) == 0
    settings = Settings(
        home=tmp_path / "home", models={"big": big, "little": little}, served_models=["big", "little"]
    )
    route = Catalog(settings.catalog).routes()[AUTO]
    assert (route.small, route.large) == ("little", "big")
