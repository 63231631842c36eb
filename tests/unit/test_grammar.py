"""Structured outputs' pure pieces: the grammar on the job's request, the token masks on the logits."""

from __future__ import annotations

import json

import torch

from app.core.grammar import Grammar, grammar_problem, json_schema
from app.core.jobrecord import JobRequest
from app.core.sampling import SamplingParams
from app.workers.grammar import apply_token_masks


def test_a_requests_grammar_survives_the_record_and_a_request_without_one_is_written_as_before() -> None:
    grammar = json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    sampling = SamplingParams(temperature=1.0, top_p=1.0, top_k=0)
    request = JobRequest(max_tokens=8, sampling=sampling, grammar=grammar)
    assert JobRequest.from_json(request.to_json()) == request
    plain = JobRequest(max_tokens=8, sampling=sampling)
    assert "grammar" not in json.loads(plain.to_json())


def test_a_schemas_properties_keep_their_declared_order() -> None:
    schema = {"type": "object", "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "integer"}}}
    assert list(json.loads(json_schema(schema).text)["properties"]) == ["zeta", "alpha"]


def test_the_engine_names_what_it_cannot_compile() -> None:
    assert grammar_problem(json_schema({"type": "object"})) is None
    assert grammar_problem(Grammar("choice", json.dumps(["a b", "c.d", "#&~-"]))) is None
    assert "strin" in (grammar_problem(json_schema({"type": "strin"})) or "")
    assert "unclosed group" in (grammar_problem(Grammar("regex", "a(b")) or "")
    assert grammar_problem(Grammar("choice", "[]")) is not None


def test_a_token_mask_keeps_its_rows_allowed_tokens_only() -> None:
    vocab = 70  # three 32-bit words, the last one partly past the vocabulary
    allowed = [{0, 31, 32, 69}, {5}, set(range(vocab))]
    bitmask = torch.zeros(3, 3, dtype=torch.int64)
    for row, tokens in enumerate(allowed):
        for token in tokens:
            bitmask[row, token // 32] |= 1 << (token % 32)
    bitmask = torch.where(bitmask >= 2**31, bitmask - 2**32, bitmask).to(torch.int32)
    logits = torch.randn(3, vocab)

    masked = apply_token_masks(logits, bitmask)  # [3, V]

    for row, tokens in enumerate(allowed):
        finite = set(masked[row].isfinite().nonzero().flatten().tolist())
        assert finite == tokens
        assert torch.equal(masked[row, sorted(tokens)], logits[row, sorted(tokens)])
