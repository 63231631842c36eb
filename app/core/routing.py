"""Adaptive routing: which served model a request for a route (`model: "auto"`) goes to, and why.

Pure: the API gathers the request's features and each candidate pipeline's state, `choose` decides.
A route has a small and a large model (`Settings.routes`, `RoutePolicy`). The request goes to the large
one when any of these holds, else to the small one:

- its prompt is longer than `max_prompt_chars` characters (characters, not tokens: routing happens
  before tokenizing, and the two models may not share a tokenizer);
- it asks for more than `max_tokens` tokens (the server's default when it names none);
- its complexity score (`complexity`, 0..1, over the first 8 KB of the prompt) is over `max_complexity`.

Then the pipelines are consulted, and the other model is taken instead when
1. the request is a chat and the preferred model has no chat template while the other has one
   (reason `fallback_chat`: a base model would refuse it 422);
2. the preferred model's pipeline is down (a stage without a live worker, or its circuit breaker
   open) and the other's is up (`fallback_down`);
3. the preferred model's predicted queue wait (admission's W = A / R) is longer than the request's
   deadline (its `timeout_s`, else the route's `deadline_s`), the other is up, and its own predicted
   wait is shorter or unknown (`fallback_deadline`; an unknown wait is a pipeline that finished
   nothing lately, which is an idle one far more often than a stuck one).
When neither model is better off, the preferred one is kept and admission answers as it would for it.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from app.core.config import RoutePolicy

AUTO = "auto"  # the route that exists by default whenever two or more generation models are served
SCORED_CHARS = 8192  # the score reads this much of the prompt: its cost stays flat for long prompts

# The complexity score's parts, each 0..1, and their weights (they sum to 1).
REASONING_WEIGHT, CODE_WEIGHT, DIGITS_WEIGHT, SENTENCE_WEIGHT = 0.4, 0.3, 0.15, 0.15
REASONING = re.compile(
    r"\b(why|explain|prove|proof|derive|step[- ]by[- ]step|compare|contrast|analy[sz]e|reason(?:ing)?|"
    r"calculate|compute|solve|justify|evaluate|therefore|implies|trade-?offs?|optimi[sz]e)\b",
    re.IGNORECASE,
)
CODE = re.compile(r"```|\bdef |\bclass |\breturn\b|\bimport |#include|\bfunction\b|=>|[{};]|\w\(\)|==")
SENTENCE_END = re.compile(r"[.!?]+(?:\s|$)|\n+")
REASONING_SATURATES = 2  # distinct reasoning words for a full reasoning part
CODE_SATURATES = 3  # distinct code markers for a full code part
DIGITS_SATURATE = 0.15  # digits and operators among the non-space characters
SENTENCE_PLAIN, SENTENCE_SPAN = 15, 20  # words per sentence: plain up to 15, full part at 35


class Reason(enum.StrEnum):
    """Why a route chose its model: the `reason` label of `conveyor_routes_total`."""

    SIMPLE = "simple"  # small: every threshold held
    PROMPT_LENGTH = "prompt_length"  # large: a long prompt
    MAX_TOKENS = "max_tokens"  # large: a long answer asked for
    COMPLEXITY = "complexity"  # large: the score was over the threshold
    FALLBACK_CHAT = "fallback_chat"
    FALLBACK_DOWN = "fallback_down"
    FALLBACK_DEADLINE = "fallback_deadline"


@dataclass(frozen=True)
class Features:
    """What the policy reads of a request."""

    prompt_chars: int
    max_tokens: int
    complexity: float  # 0..1, `complexity`
    chat: bool = False  # messages, rendered by the model's chat template
    timeout_s: float | None = None  # the job's own deadline to start, if it gave one


@dataclass(frozen=True)
class PipelineState:
    """A candidate model's pipeline as admission sees it now."""

    up: bool  # every stage has a live worker and the circuit breaker admits
    predicted_wait_s: float | None  # admission's W = A / R; None without a measured rate
    chat: bool = True  # its tokenizer has a chat template


@dataclass(frozen=True)
class Route:
    """A route resolved against the served models."""

    name: str
    small: str
    large: str
    policy: RoutePolicy

    def other(self, model: str) -> str:
        return self.large if model == self.small else self.small


class Choice(NamedTuple):
    """`(model, reason)`: the served model a route chose, and why."""

    model: str
    reason: Reason


class RouteConfigError(ValueError):
    """CONVEYOR_ROUTES names what cannot be served: the API refuses to start, saying which and why."""


def complexity(prompt: str) -> float:
    """A cheap 0..1 guess at how hard a prompt is, from its first SCORED_CHARS characters:
    0.4 x reasoning words (why, explain, prove, step by step, ...; two distinct saturate)
    + 0.3 x code markers (``` def class return { } ; f() ...; three distinct saturate)
    + 0.15 x digit and operator density (15% of the non-space characters saturates)
    + 0.15 x mean sentence length (15 words scores 0, 35 and more 1).
    Regular expressions over 8 KB: tens of microseconds, nothing next to tokenizing."""
    text = prompt[:SCORED_CHARS]
    reasoning = len({m.lower().replace("-", " ") for m in REASONING.findall(text)})
    code = len(set(CODE.findall(text)))
    dense = sum(1 for c in text if not c.isspace())
    digits = sum(1 for c in text if c.isdigit() or c in "+-*/=^%<>")
    sentences = [s for s in SENTENCE_END.split(text) if s.strip()]
    words = sum(len(s.split()) for s in sentences) / len(sentences) if sentences else 0.0
    score = (
        REASONING_WEIGHT * min(1.0, reasoning / REASONING_SATURATES)
        + CODE_WEIGHT * min(1.0, code / CODE_SATURATES)
        + DIGITS_WEIGHT * min(1.0, digits / dense / DIGITS_SATURATE if dense else 0.0)
        + SENTENCE_WEIGHT * min(1.0, max(0.0, (words - SENTENCE_PLAIN) / SENTENCE_SPAN))
    )
    return round(score, 4)


def features(prompt: str, *, max_tokens: int, chat: bool = False, timeout_s: float | None = None) -> Features:
    """A request's features; `prompt` is its text (a chat's message contents, joined)."""
    return Features(len(prompt), max_tokens, complexity(prompt), chat, timeout_s)


def prefer(route: Route, request: Features) -> Choice:
    """The policy alone, before any pipeline is consulted."""
    policy = route.policy
    if request.prompt_chars > policy.max_prompt_chars:
        return Choice(route.large, Reason.PROMPT_LENGTH)
    if request.max_tokens > policy.max_tokens:
        return Choice(route.large, Reason.MAX_TOKENS)
    if request.complexity > policy.max_complexity:
        return Choice(route.large, Reason.COMPLEXITY)
    return Choice(route.small, Reason.SIMPLE)


def choose(route: Route, request: Features, state: Mapping[str, PipelineState]) -> Choice:
    """The model a request for `route` goes to, and why (the module docstring's rules, in order).
    `state` holds both of the route's models."""
    chosen = prefer(route, request)
    other = route.other(chosen.model)
    mine, theirs = state[chosen.model], state[other]
    takes = theirs.up and (theirs.chat or not request.chat)  # the other could serve this request
    if request.chat and not mine.chat and theirs.chat:
        return Choice(other, Reason.FALLBACK_CHAT)
    if not mine.up and takes:
        return Choice(other, Reason.FALLBACK_DOWN)
    deadline = request.timeout_s if request.timeout_s is not None else route.policy.deadline_s
    wait = mine.predicted_wait_s
    if wait is not None and wait > deadline and takes:
        if theirs.predicted_wait_s is None or theirs.predicted_wait_s < wait:
            return Choice(other, Reason.FALLBACK_DEADLINE)
    return chosen


def resolve(
    configured: Mapping[str, RoutePolicy], served: Sequence[str], sizes: Mapping[str, int]
) -> dict[str, Route]:
    """The routes a request may name: those configured, and `auto` (unless configured) when two or more
    generation models are served. An unset small or large is the served model with the fewest or the
    most parameters (`sizes`; unknown counts as 0, ties by the order served). Raises RouteConfigError
    for a route that names a model not served, collides with a model's name, or has fewer than two."""
    routes = dict(configured)
    if AUTO not in routes and len(served) >= 2:
        routes[AUTO] = RoutePolicy()
    by_size = sorted(served, key=lambda name: (sizes.get(name, 0), served.index(name)))
    resolved = {}
    for name, policy in routes.items():
        if name in served:
            raise RouteConfigError(f"route {name!r} has the name of a served model; rename the route")
        for model in (policy.small, policy.large):
            if model is not None and model not in served:
                raise RouteConfigError(
                    f"route {name!r} names model {model!r}, which is not served; served: {list(served)}"
                )
        small = policy.small or next((m for m in by_size if m != policy.large), None)
        large = policy.large or next((m for m in reversed(by_size) if m != small), None)
        if small is None or large is None or small == large:
            raise RouteConfigError(f"route {name!r} needs two served models; served: {list(served)}")
        resolved[name] = Route(name, small, large, policy)
    return resolved
