"""A job's output grammar (structured outputs): what the text must match, and whether the engine can
compile it.

The API checks a grammar when the job is submitted (`grammar_problem`: 422 naming the problem), the
job's request carries it (`JobRequest.grammar`), and the last stage constrains each sampled token to
it (`app.workers.grammar`). The engine is llguidance (docs/benchmarks.md, "Structured outputs": its
token masks are the cheapest of the engines measured, it compiles a schema in under a millisecond,
and it needs no other package); every kind of grammar becomes an llguidance grammar here
(`engine_grammar`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

GrammarKind = Literal["json_schema", "regex", "choice", "lark"]

# Compact JSON: no whitespace between tokens. Free whitespace lets a small model write newlines
# for ever instead of closing the object.
JSON_OPTIONS = {"whitespace_flexible": False}


@dataclass(frozen=True)
class Grammar:
    """What the completion's text must match.

    kind: `json_schema` (text: the schema as JSON text; `{"type": "object"}` is any JSON object),
    `regex` (text: the pattern, matched whole), `choice` (text: a JSON list of strings, exactly
    one of them), `lark` (text: a Lark grammar, as llguidance reads it)."""

    kind: GrammarKind
    text: str

    def to_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "text": self.text}

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> Grammar:
        return cls(kind=value["kind"], text=value["text"])


def json_schema(schema: dict[str, Any]) -> Grammar:
    """The schema's keys keep their order: the answer's properties come in the order they are declared."""
    return Grammar("json_schema", json.dumps(schema, separators=(",", ":")))


def engine_grammar(grammar: Grammar) -> str:
    """The grammar as llguidance takes it (raises ValueError for text that is not what its kind says)."""
    from llguidance import LLMatcher

    if grammar.kind == "json_schema":
        return str(LLMatcher.grammar_from_json_schema(grammar.text, defaults=JSON_OPTIONS))  # type: ignore[arg-type]
    if grammar.kind == "regex":
        return str(LLMatcher.grammar_from_regex(grammar.text))
    if grammar.kind == "choice":
        choices = json.loads(grammar.text)
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
            raise ValueError("choice must be a non-empty list of strings")
        return str(LLMatcher.grammar_from_regex("|".join(f"({re.escape(c)})" for c in choices)))
    if grammar.kind == "lark":
        return str(LLMatcher.grammar_from_lark(grammar.text))
    raise ValueError(f"unknown grammar kind {grammar.kind!r}")


def grammar_problem(grammar: Grammar) -> str | None:
    """Why the engine cannot compile this grammar (its own words), or None when it can."""
    from llguidance import LLMatcher

    try:
        problem = str(LLMatcher.validate_grammar(engine_grammar(grammar)))
    except Exception as exc:  # whatever the engine refuses to read is a problem of the request
        return f"{type(exc).__name__}: {exc}" if not isinstance(exc, ValueError) else str(exc)
    return problem.strip() or None
