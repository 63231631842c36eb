"""Structured outputs' cost on this CPU: llguidance (the engine `app.workers.grammar` uses) with
SmolLM2's tokenizer (vocabulary 49152):

    tokenizer   seconds to prepare the tokenizer for the engine (once per worker)
    compile     median ms to compile one JSON schema (a person with a nested address, a list and an enum)
    mask        median µs to compute one row's token mask at one step, over a batch of --rows rows
                each walking a valid answer (rows at different places of it), one row after another
    mask par    the same through llguidance's batch call (its executor)
    apply       median µs per row to apply the batch's packed masks to its logits in torch

    .venv/bin/python -m bench.grammar [--rows 64] [--steps 40] [--model PATH]

xgrammar and outlines-core were measured beside it by this script as it was at commit 1a0b1cb
(`git show 1a0b1cb:bench/grammar.py`) when the engine was chosen.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import llguidance
import llguidance.hf
import torch
from transformers import AutoTokenizer

from app.workers.grammar import apply_token_masks
from bench.report import median_ms, timed

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string"},
            },
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "email", "role", "tags", "address"],
    "additionalProperties": False,
}
ANSWER = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@example.org",
    "role": "admin",
    "tags": ["math", "engines", "poetry"],
    "address": {"street": "12 St James's Square", "city": "London", "zip": "SW1Y 4JH"},
}


def compile_schema(tokenizer: Any, schema: dict[str, Any]) -> Any:
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return grammar


def consume(matcher: Any, token: int) -> bool:
    return bool(matcher.consume_token(token)) and not matcher.is_error()


def measure(tokenizer: Any, answer: list[int], *, rows: int, steps: int, vocab: int) -> dict[str, float]:
    compile_ms = median_ms([timed(lambda: compile_schema(tokenizer, SCHEMA)) for _ in range(5)])
    compiled = compile_schema(tokenizer, SCHEMA)
    executor = llguidance.LLExecutor(num_threads=2)
    # Row r starts r tokens into the answer (wrapping), so the batch holds rows at every place of it.
    matchers, places = [], []
    for r in range(rows):
        matcher = llguidance.LLMatcher(tokenizer, compiled, log_level=0)
        place = r % max(1, len(answer) - steps)
        for token in answer[:place]:
            assert consume(matcher, token), f"llguidance refused the answer's token {token}"
        matchers.append(matcher)
        places.append(place)
    bitmask = torch.full((rows, (vocab + 31) // 32), -1, dtype=torch.int32)  # [B, vocab / 32] packed
    logits = torch.randn(rows, vocab)  # [B, vocab]
    serial, par, apply = [], [], []
    for step in range(steps):
        started = time.perf_counter()
        for r, matcher in enumerate(matchers):
            view = bitmask[r]
            matcher.unsafe_compute_mask_ptr(view.data_ptr(), view.numel() * 4)
        serial.append((time.perf_counter() - started) / rows)
        pairs = [(m, i) for i, m in enumerate(matchers)]
        started = time.perf_counter()
        executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), bitmask.shape[1] * 4, rows)
        par.append((time.perf_counter() - started) / rows)
        apply.append(timed(lambda: apply_token_masks(logits, bitmask)) / rows)
        for r, matcher in enumerate(matchers):
            token = answer[places[r] + step]
            assert bitmask[r, token // 32] >> (token % 32) & 1, "llguidance masked the answer's token"
            assert consume(matcher, token)
    return {
        "compile_ms": compile_ms,
        "mask_us": statistics.median(serial) * 1e6,
        "par_us": statistics.median(par) * 1e6,
        "apply_us": statistics.median(apply) * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=".conveyor/models/SmolLM2-135M-Instruct")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    answer = tokenizer.encode(json.dumps(ANSWER, separators=(",", ":")), add_special_tokens=False)
    print(f"vocabulary {len(tokenizer)}, answer {len(answer)} tokens, batch {args.rows}, {args.steps} steps")
    heads = ("tokenizer s", "compile ms", "mask µs/row", "par µs/row", "apply µs/row")
    print(f"{'engine':<14} " + " ".join(f"{h:>12}" for h in heads))
    started = time.perf_counter()
    engine_tokenizer = llguidance.hf.from_tokenizer(tokenizer)
    setup = time.perf_counter() - started
    got = measure(engine_tokenizer, answer, rows=args.rows, steps=args.steps, vocab=len(tokenizer))
    print(
        f"{'llguidance':<14} {setup:>12.2f} {got['compile_ms']:>12.2f} {got['mask_us']:>12.1f} "
        f"{got['par_us']:>12.1f} {got['apply_us']:>12.1f}"
    )


if __name__ == "__main__":
    main()
