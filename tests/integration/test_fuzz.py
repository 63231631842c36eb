"""Schemathesis against the API's own OpenAPI schema, with every check it has, on a running stack.

Each operation gets a bounded, derandomized set of examples (positive and negative), so a failure
in CI reproduces on a laptop. A failure is a real API bug (a 500, an undeclared status or content
type, a body that does not match its declared schema) or a gap in the schema's declarations.

The schema is the app factory's (built at collection, so each operation is its own test item), and
test_the_stack_serves_this_schema holds it to the one the stack serves. Schemathesis' fixture-loaded
schemas (`schemathesis.pytest.from_fixture`) do not run on pytest 9.2: they set `Function._nodeid`,
which pytest 9.2 no longer has.

Not fuzzed: the WebSocket route (/v1/ws/...). OpenAPI does not describe WebSockets (FastAPI leaves
them out of the schema) and HTTP requests cannot reach it; tests/integration/test_ws.py covers it.
"""

from __future__ import annotations

from typing import Any

import schemathesis
from schemathesis import checks
from schemathesis.core.transport import Response
from schemathesis.generation.case import Case

from app.api.app import create_app
from app.core.config import Settings

# Per operation: enough to walk each schema's branches and their negations, few enough that the
# whole run (generating on the tiny model, on CPU) stays around a minute.
MAX_EXAMPLES = 25
# A job generates in well under a second on the tiny model, but may queue behind the others'.
REQUEST_TIMEOUT_S = 60.0
# Blocking routes (/v1/inference, the OpenAI completions, `stream: true`) wait for their job's
# end: every generated job stays short.
MAX_TOKENS = 4

schema = schemathesis.openapi.from_dict(create_app(Settings()).openapi())
schema.config.generation.update(max_examples=MAX_EXAMPLES, deterministic=True)


# The largest seed (an int64): JSON Schema validators compare numbers as doubles, so Schemathesis
# takes a generated 2**63 + 192 for one under `maximum` 2**63 - 1; the API rightly refuses it.
MAX_SEED = 2**63 - 1


def capped(body: Any, name: str, cap: int) -> None:
    """Caps an int above `cap` (only those, so a negative case stays negative)."""
    if isinstance(body, dict):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            body[name] = cap


def short_jobs(body: Any) -> None:
    for name in ("max_tokens", "max_completion_tokens"):
        capped(body, name, MAX_TOKENS)
    capped(body, "seed", MAX_SEED)


def test_the_stack_serves_this_schema(stack):  # type: ignore[no-untyped-def]
    with stack.client() as client:
        assert client.get("/openapi.json").json() == schema.raw_schema


# Refusals of schema-valid input that no static schema can state: limits the operator configures
# (max_tokens, timeout_s, stop strings: each error carries its `details.limit`), what depends on the
# model's tokenizer (an empty or too long prompt, a token id past its vocabulary, what its chat
# template renders), the SSRF guard on callback URLs, and the rules that
# tie two fields together.
SEMANTIC_CODES = {"max_tokens_exceeded", "context_length_exceeded", "callback_url_refused"}
CROSS_FIELD_RULES = (
    "give exactly one of 'prompt' or 'messages'",  # /tokenize
    "give exactly one of 'prompt', 'prompt_token_ids' or 'messages'",
    "callback_events needs a callback_url",
    "the prompt is empty",
    "continue_final_message needs add_generation_prompt",
    "applies only to 'messages'",
    "applies only to /v1/chat/completions",
    "may not set",  # chat_template_kwargs naming one of the template's own arguments
    "the chat template could not render",
    "outside the vocabulary",  # a token id past the model's vocabulary
    "top_logprobs needs logprobs",
    # structured outputs: what the grammar engine cannot compile, or two constraints at once
    "cannot be compiled",
    "cannot compile it",
    "a choice needs at least one string",
    "give one structured output at most",
    "cannot be used with a grammar",
    "the JSON schema is not JSON",
    "a JSON schema is a JSON object",
    "needs its json_schema",
    "structured_outputs takes exactly one of",
    # tools: what a tool, a call or a choice must be beside the rest of the request
    "a function's parameters are a JSON schema of type object",
    "is defined twice",
    "tool_choice needs tools",
    "which is not among the tools",
    "tools applies only to 'messages'",
    "only an assistant message has tool_calls",
    "names the call it answers (tool_call_id)",
    "needs its content",
    "arguments are the text of a JSON object",
    "cannot be used with another structured output",
    "write tool calls in different formats",
)


def error_of(response: Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {}
    error = body.get("error") if isinstance(body, dict) else None
    return error if isinstance(error, dict) else {}


def semantic_refusal(response: Response) -> bool:
    """A 422 for a schema-valid request that only the server can decide (see SEMANTIC_CODES)."""
    error = error_of(response)
    if response.status_code != 422:
        return False
    if error.get("code") in SEMANTIC_CODES or "limit" in (error.get("details") or {}):
        return True
    return any(rule in str(error.get("message", "")) for rule in CROSS_FIELD_RULES)


def not_served(case: Case, response: Response) -> bool:
    """This stack runs no embeddings pipeline (CONVEYOR_EMBEDDING_STAGES=0), so /v1/embeddings answers
    its declared 503 not_served: the service working, not a server error."""
    if case.operation.path != "/v1/embeddings" or response.status_code != 503:
        return False
    return bool(error_of(response).get("code") == "not_served")


@schema.parametrize()
def test_api_conforms_to_its_schema(case: Case, stack) -> None:  # type: ignore[no-untyped-def]
    short_jobs(case.body)
    sent = {"base_url": stack.url, "timeout": REQUEST_TIMEOUT_S}  # the checks' probes send the same way
    response = case.call(**sent)
    # ignored_auth: the shared stack has no credentials configured, so every caller is tenant
    # 'anonymous' and any credential (or none) is accepted by design; tests/integration/test_tenancy.py
    # covers a stack that enforces them.
    excluded = [checks.ignored_auth]
    if not_served(case, response):
        excluded.append(checks.not_a_server_error)
    if semantic_refusal(response):
        excluded.append(checks.positive_data_acceptance)
    case.validate_response(response, excluded_checks=excluded, transport_kwargs=sent)
