"""Structured outputs on the last stage: one matcher per constrained sequence, its token mask applied
to its row of the step's logits, advanced by each sampled token.

`Grammars` compiles a job's grammar (`app.core.grammar`) for the model's tokenizer once, keeps the
compiled grammars in a bounded LRU, and hands each new sequence a fresh `Matcher` (a copy of the
compiled one). `StageRuntime._sample` calls `constrain` before sampling; `decode.advance` consumes
the sampled token and ends the sequence when its grammar is complete.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from app.core.errors import InvalidRequest
from app.core.grammar import Grammar, engine_grammar

# Compiled grammars kept per worker. A JSON schema compiles in about a millisecond (docs/benchmarks.md),
# so a miss costs little; the bound keeps a stream of distinct schemas from growing the worker's memory.
GRAMMAR_CACHE_SIZE = 256


class GrammarError(InvalidRequest):
    """A sequence's output can no longer follow its grammar (its job fails alone)."""


class Matcher:
    """Where one sequence stands in its grammar."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner  # llguidance.LLMatcher

    @property
    def done(self) -> bool:
        """The grammar is complete and nothing may follow: the sequence ends here."""
        return bool(self.inner.is_stopped())

    def consume(self, token: int) -> None:
        if not self.inner.consume_token(token) or self.inner.is_error():
            raise GrammarError(
                f"token {token} does not follow the output's grammar: {self.inner.get_error()}"
            )


class Grammars:
    """The last stage's compiled grammars for one tokenizer (the tokenizer is wrapped for the engine
    on first use: about a second for SmolLM2's)."""

    def __init__(
        self, tokenizer: Any, *, eos_ids: frozenset[int], vocab_size: int, capacity: int = GRAMMAR_CACHE_SIZE
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.vocab_size = vocab_size
        self.capacity = capacity
        self._engine_tokenizer: Any = None
        self._executor: Any = None
        self._compiled: OrderedDict[Grammar, Any] = OrderedDict()

    def matcher(self, grammar: Grammar) -> Matcher:
        """A fresh matcher at the start of `grammar` (compiled once while it stays in the cache)."""
        compiled = self._compiled.get(grammar)
        if compiled is None:
            compiled = self._compile(grammar)
            self._compiled[grammar] = compiled
            while len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(grammar)
        return Matcher(compiled.deep_copy())

    def __len__(self) -> int:
        return len(self._compiled)

    def _compile(self, grammar: Grammar) -> Any:
        import llguidance

        try:
            text = engine_grammar(grammar)
        except ValueError as exc:
            raise GrammarError(f"the output's grammar cannot be compiled: {exc}") from None
        compiled = llguidance.LLMatcher(self._tokenizer(), text, log_level=0)
        if compiled.is_error():
            raise GrammarError(f"the output's grammar cannot be compiled: {compiled.get_error()}")
        return compiled

    def _tokenizer(self) -> Any:
        if self._engine_tokenizer is None:
            import llguidance.hf

            self._engine_tokenizer = llguidance.hf.from_tokenizer(
                self.tokenizer,
                n_vocab=max(self.vocab_size, len(self.tokenizer)),
                eos_token=sorted(self.eos_ids),
            )
        return self._engine_tokenizer

    def fill(self, matchers: list[Matcher], bitmask: torch.Tensor) -> None:
        """Row i of `bitmask` ([R, W] int32, C-contiguous): the tokens matchers[i] allows now."""
        import llguidance

        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        pairs = [(m.inner, i) for i, m in enumerate(matchers)]
        self._executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), bitmask.shape[1] * 4, len(matchers))

    def constrain(
        self, logits: torch.Tensor, matchers: list[Matcher | None]
    ) -> tuple[torch.Tensor, list[int]]:
        """Each constrained row's logits with the tokens its grammar forbids at -inf (rows without a
        grammar untouched), and the rows whose grammar allows no token at all (they cannot go on).
        logits: [B, V]; one matcher or None per row."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return logits, []
        words = (max(self.vocab_size, len(self.tokenizer)) + 31) // 32
        bitmask = torch.zeros((len(rows), words), dtype=torch.int32)  # [R, W]
        self.fill([m for m in matchers if m is not None], bitmask)
        index = torch.tensor(rows)
        out = logits.clone()
        out[index] = apply_token_masks(logits[index], bitmask)
        stuck = (~out[index].isfinite().any(dim=-1)).nonzero().flatten().tolist()
        return out, [rows[i] for i in stuck]


def apply_token_masks(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits: [R, V]; bitmask: [R, W] int32, bit j of word w allowing token 32 w + j (tokens past
    32 W are not allowed). Returns the logits with the tokens not allowed at -inf.

    Unpacked by numpy (`unpackbits`: 2-3 times faster on the CPU than shifting in torch)."""
    vocab = logits.shape[-1]
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")  # [R, 32 W]
    allowed = torch.zeros(logits.shape, dtype=torch.bool)
    width = min(vocab, bits.shape[1])
    allowed[:, :width] = torch.from_numpy(bits[:, :width].view(np.bool_))
    return torch.where(allowed, logits, float("-inf"))
