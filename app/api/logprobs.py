"""Token events' log probabilities (`logprob`, `top_logprobs`: token ids) in OpenAI's two shapes:
the legacy completions' lists and the chat completions' per-token objects. Token ids become text
with the model's tokenizer, one token at a time (as vLLM names them), or `token_id:<id>` with
vLLM's `return_tokens_as_token_ids`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from app.api.openai_schemas import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob

# JSON has no -inf: as vLLM, a log probability below this is sent as this.
FLOOR = -9999.0


class TokenLogprobs:
    """One per answer; `completion` keeps the text offset across a stream's chunks."""

    def __init__(self, tokenizer: Any, *, as_ids: bool = False) -> None:
        self.tokenizer = tokenizer
        self.as_ids = as_ids
        self.offset = 0  # characters of the completion before the next token

    def name(self, token_id: int) -> str:
        if self.as_ids:
            return f"token_id:{token_id}"
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False))

    def completion(self, events: list[Mapping[str, Any]]) -> CompletionLogprobs | None:
        """Legacy completions' lists for these token events (None when they carry none)."""
        events = [e for e in events if "logprob" in e]
        if not events:
            return None
        tokens: list[str] = []
        offsets: list[int] = []
        tops: list[dict[str, float] | None] = []
        for event in events:
            token = self.name(int(event["token_id"]))
            tokens.append(token)
            offsets.append(self.offset)
            self.offset += len(token)
            top = {self.name(int(t)): _floor(lp) for t, lp in event["top_logprobs"]}
            top.setdefault(token, _floor(event["logprob"]))  # the chosen token is always listed
            tops.append(top)
        return CompletionLogprobs(
            text_offset=offsets,
            token_logprobs=[_floor(e["logprob"]) for e in events],
            tokens=tokens,
            top_logprobs=tops,
        )

    def chat(self, events: list[Mapping[str, Any]]) -> ChatLogprobs | None:
        """Chat completions' `content` entries for these token events (None when they carry none)."""
        events = [e for e in events if "logprob" in e]
        if not events:
            return None
        content = [
            TokenLogprob(
                **self._top(int(e["token_id"]), e["logprob"]).model_dump(),
                top_logprobs=[self._top(int(t), lp) for t, lp in e["top_logprobs"]],
            )
            for e in events
        ]
        return ChatLogprobs(content=content)

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        token = self.name(token_id)
        return TopLogprob(token=token, logprob=_floor(logprob), bytes=list(token.encode("utf-8")))


def _floor(logprob: float) -> float:
    return max(float(logprob), FLOOR)
