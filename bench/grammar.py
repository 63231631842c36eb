"""Grammar engines for structured outputs, side by side on this CPU: llguidance, xgrammar, outlines-core.

With SmolLM2's tokenizer (vocabulary 49152), for each engine that imports:

    tokenizer   seconds to prepare the tokenizer for the engine (once per worker)
    compile     median ms to compile one JSON schema (a person with a nested address, a list and an enum)
    mask        median µs to compute one row's token mask at one step, over a batch of --rows rows
                each walking a valid answer (rows at different places of it), one row after another
    mask par    the same through the engine's batch call where it has one (llguidance's executor)
    apply       median µs per row to apply the batch's packed masks to its logits in torch (the same
                for every engine: the masks are the same 32-bit packed rows)

An engine that is not installed is skipped. Install the candidates outside the project's venv to
compare them: `pip install --no-deps --target /tmp/engines llguidance xgrammar apache-tvm-ffi
outlines-core`, then `PYTHONPATH=/tmp/engines`.

    .venv/bin/python -m bench.grammar [--rows 64] [--steps 40] [--model PATH]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import AutoTokenizer

from app.workers.grammar import apply_token_masks

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


class Engine:
    name = ""

    def __init__(self, tokenizer: Any) -> None:
        raise NotImplementedError

    def compile(self, schema: dict[str, Any]) -> Any:
        raise NotImplementedError

    def matcher(self, compiled: Any) -> Any:
        raise NotImplementedError

    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        raise NotImplementedError

    def fill_batch(self, matchers: list[Any], bitmask: torch.Tensor) -> bool:
        return False

    def consume(self, matcher: Any, token: int) -> bool:
        raise NotImplementedError


class LLGuidance(Engine):
    name = "llguidance"

    def __init__(self, tokenizer: Any) -> None:
        import llguidance
        import llguidance.hf

        self.lib = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer)
        self.executor = llguidance.LLExecutor(num_threads=2)

    def compile(self, schema: dict[str, Any]) -> Any:
        grammar = self.lib.LLMatcher.grammar_from_json_schema(schema)
        matcher = self.lib.LLMatcher(self.tokenizer, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return grammar

    def matcher(self, compiled: Any) -> Any:
        return self.lib.LLMatcher(self.tokenizer, compiled, log_level=0)

    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        view = bitmask[row]
        matcher.unsafe_compute_mask_ptr(view.data_ptr(), view.numel() * 4)

    def fill_batch(self, matchers: list[Any], bitmask: torch.Tensor) -> bool:
        pairs = [(m, i) for i, m in enumerate(matchers)]
        self.executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), bitmask.shape[1] * 4, len(matchers))
        return True

    def consume(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token)) and not matcher.is_error()


class XGrammar(Engine):
    name = "xgrammar"

    def __init__(self, tokenizer: Any) -> None:
        import xgrammar

        self.lib = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, schema: dict[str, Any]) -> Any:
        return self.compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(",", ":")
        )

    def matcher(self, compiled: Any) -> Any:
        return self.lib.GrammarMatcher(compiled)

    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def consume(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))


class OutlinesCore(Engine):
    name = "outlines-core"

    def __init__(self, tokenizer: Any) -> None:
        import outlines_core

        self.lib = outlines_core
        decode = byte_level_decoder()
        tokens: dict[bytes, list[int]] = {}
        for piece, token in tokenizer.get_vocab().items():
            if token == tokenizer.eos_token_id or token in tokenizer.all_special_ids:
                continue
            if all(c in decode for c in piece):
                tokens.setdefault(bytes(decode[c] for c in piece), []).append(token)
        self.vocabulary = outlines_core.Vocabulary(tokenizer.eos_token_id, tokens)

    def compile(self, schema: dict[str, Any]) -> Any:
        from outlines_core.json_schema import build_regex_from_schema

        return self.lib.Index(build_regex_from_schema(json.dumps(schema), None), self.vocabulary)

    def matcher(self, compiled: Any) -> Any:
        return self.lib.Guide(compiled)

    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        view = bitmask[row]
        matcher.write_mask_into(view.data_ptr(), view.numel(), 4)

    def consume(self, matcher: Any, token: int) -> bool:
        matcher.advance(token)
        return True


def byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte in a token's text."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(extra)}
    return {c: b for b, c in chars.items()}


ENGINES: dict[str, tuple[str, type[Engine]]] = {
    "llguidance": ("llguidance", LLGuidance),
    "xgrammar": ("xgrammar", XGrammar),
    "outlines-core": ("outlines_core", OutlinesCore),
}


def median_ms(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def measure(engine: Engine, answer: list[int], *, rows: int, steps: int, vocab: int) -> dict[str, float]:
    compile_ms = median_ms(lambda: engine.compile(SCHEMA), 5)
    compiled = engine.compile(SCHEMA)
    # Row r starts r tokens into the answer (wrapping), so the batch holds rows at every place of it.
    matchers, places = [], []
    for r in range(rows):
        matcher = engine.matcher(compiled)
        place = r % max(1, len(answer) - steps)
        for token in answer[:place]:
            assert engine.consume(matcher, token), f"{engine.name} refused the answer's token {token}"
        matchers.append(matcher)
        places.append(place)
    bitmask = torch.full((rows, (vocab + 31) // 32), -1, dtype=torch.int32)
    logits = torch.randn(rows, vocab)
    serial, par, apply = [], [], []
    for step in range(steps):
        started = time.perf_counter()
        for r, matcher in enumerate(matchers):
            engine.fill(matcher, bitmask, r)
        serial.append((time.perf_counter() - started) / rows)
        started = time.perf_counter()
        if engine.fill_batch(matchers, bitmask):
            par.append((time.perf_counter() - started) / rows)
        started = time.perf_counter()
        apply_token_masks(logits, bitmask)
        apply.append((time.perf_counter() - started) / rows)
        for r, matcher in enumerate(matchers):
            token = answer[places[r] + step]
            assert bitmask[r, token // 32] >> (token % 32) & 1, f"{engine.name} masked the answer's token"
            assert engine.consume(matcher, token)
    return {
        "compile_ms": compile_ms,
        "mask_us": statistics.median(serial) * 1e6,
        "par_us": statistics.median(par) * 1e6 if par else float("nan"),
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
    for name, (module, cls) in ENGINES.items():
        if importlib.util.find_spec(module) is None:
            print(f"{name:<14} not installed")
            continue
        started = time.perf_counter()
        engine = cls(tokenizer)
        setup = time.perf_counter() - started
        try:
            got = measure(engine, answer, rows=args.rows, steps=args.steps, vocab=len(tokenizer))
        except AssertionError as exc:
            print(f"{name:<14} {setup:>12.2f} failed: {exc}")
            continue
        print(
            f"{name:<14} {setup:>12.2f} {got['compile_ms']:>12.2f} {got['mask_us']:>12.1f} "
            f"{got['par_us']:>12.1f} {got['apply_us']:>12.1f}"
        )


if __name__ == "__main__":
    main()
