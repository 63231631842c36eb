"""Incremental detokenization with stop strings.

Text is released to clients only when it can no longer change: an incomplete UTF-8 sequence, or
a tail that might be the start of a stop string, is held back. The concatenation of everything
released is exactly the job's final text, so streamed tokens always add up to the polled result.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(
        self, tokenizer: Any, stop: list[str] | None = None, *, skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in (stop or []) if s]
        self.ids: list[int] = []
        self.released = ""
        self.stopped = False  # a stop string was generated

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text that became final with it (may be empty)."""
        self.ids.append(token_id)
        full = self._decode()
        cut = self._stop_at(full)
        if cut is not None:
            self.stopped = True
            return self._release(full[:cut])
        if full.endswith(REPLACEMENT):  # the token ends mid-character: wait for the rest
            return ""
        return self._release(full[: len(full) - self._held_tail(full)])

    def finish(self) -> str:
        """The sequence ended (EOS, length): release whatever was held back."""
        if self.stopped:
            return ""
        return self._release(self._decode())

    def _decode(self) -> str:
        return self.tokenizer.decode(
            self.ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def _release(self, text: str) -> str:
        if len(text) <= len(self.released):
            return ""
        new = text[len(self.released) :]
        self.released = text
        return new

    def _stop_at(self, full: str) -> int | None:
        # Only text not yet released can hold a new stop string (released text held none).
        start = max(0, len(self.released) - max((len(s) for s in self.stop), default=0))
        hits = [i for i in (full.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _held_tail(self, full: str) -> int:
        """Length of the longest tail of `full` that is a proper prefix of some stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(full)), longest, -1):
                if full.endswith(s[:n]):
                    longest = n
                    break
        return longest
