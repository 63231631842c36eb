"""How the OpenAI endpoints answer from a job: the whole completion from its record, or its stream's
chunks from its token events (`Reply`), with the token events' log probabilities (`logprob`,
`top_logprobs`: token ids) in OpenAI's two shapes (`TokenLogprobs`) and vLLM's token ids when asked.

Token ids become text with the model's tokenizer, one token at a time (as vLLM names them), or
`token_id:<id>` with vLLM's `return_tokens_as_token_ids`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel

from app.api.openai_answers import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionUsage,
    TokenLogprob,
    TopLogprob,
)
from app.api.toolcalls import ToolCalls, ToolUse
from app.core.jobrecord import JobRecord

Tokens = Sequence[Mapping[str, Any]]  # token events' data

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

    def prompt(self, prompt_ids: Sequence[int], entries: Sequence[Any]) -> CompletionLogprobs:
        """Echo's lists for the prompt's tokens: the first has no log probability (nothing comes
        before it); `entries` (a `prompt` event's `prompt_logprobs`) give each later one its
        [logprob, [[id, logprob], ...]]."""
        tokens = [self.name(t) for t in prompt_ids]
        offsets = []
        for token in tokens:
            offsets.append(self.offset)
            self.offset += len(token)
        logprobs: list[float | None] = [None]
        tops: list[dict[str, float] | None] = [None]
        for token, (logprob, top) in zip(tokens[1:], entries, strict=False):
            named = {self.name(int(t)): _floor(lp) for t, lp in top}
            named.setdefault(token, _floor(logprob))
            logprobs.append(_floor(logprob))
            tops.append(named)
        return CompletionLogprobs(
            text_offset=offsets, token_logprobs=logprobs, tokens=tokens, top_logprobs=tops
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


class Reply:
    """How one endpoint answers: the whole completion, or its stream's chunks. Named after its job.
    `tokens`: the token events (their data) the answer or chunk covers, read for their logprobs
    when the request asked for them (`logprobs`)."""

    prefix = ""

    def __init__(
        self,
        record: JobRecord,
        logprobs: TokenLogprobs | None = None,
        *,
        token_ids: bool = False,
        index: int = 0,
        echo: str | None = None,
    ) -> None:
        self.logprobs = logprobs
        self.index = index  # the choice's place in the answer's `choices`
        self.echo = echo  # completions' echo: the prompt's text, before the completion's
        self.echo_ids: list[int] = list(record.prompt_ids or ()) if echo is not None else []
        # return_token_ids: the prompt's ids (sent once), and each answer's or chunk's token ids
        self.token_ids = token_ids
        self.prompt_ids: list[int] | None = (
            list(record.prompt_ids) if token_ids and record.prompt_ids is not None else None
        )
        self.id = f"{self.prefix}{record.id}"
        self.created = int(record.created_at)
        self.model = record.model
        self.prompt_tokens = record.prompt_tokens or 0

    def so_far(self, completion_tokens: int) -> CompletionUsage:
        """The usage after `completion_tokens` tokens (`continuous_usage_stats`: on every chunk)."""
        return CompletionUsage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=self.prompt_tokens + completion_tokens,
        )

    def whole(
        self, record: JobRecord, tokens: Tokens = (), prompt: Mapping[str, Any] | None = None
    ) -> BaseModel:
        raise NotImplementedError

    def first(self, usage: CompletionUsage | None = None) -> BaseModel | None:
        return None

    def echoed(self, data: Mapping[str, Any], usage: CompletionUsage | None = None) -> BaseModel | None:
        """The chunk a job's `prompt` event gives a stream (echo with logprobs): None for others."""
        return None

    def delta(self, text: str, usage: CompletionUsage | None = None, tokens: Tokens = ()) -> BaseModel | None:
        """The chunk for the next piece of text; None when nothing can be sent yet."""
        raise NotImplementedError

    def last(
        self, finish_reason: str | None, usage: CompletionUsage | None = None, tokens: Tokens = ()
    ) -> BaseModel:
        raise NotImplementedError

    def usage(self, usage: CompletionUsage) -> BaseModel:
        raise NotImplementedError

    def ids(self, tokens: Tokens) -> list[int] | None:
        """The token ids of these events, when return_token_ids asked for them."""
        return [int(t["token_id"]) for t in tokens] if self.token_ids else None

    def prompt_once(self) -> list[int] | None:
        """The prompt's ids, the first time only (a stream sends them in its first chunk)."""
        prompt, self.prompt_ids = self.prompt_ids, None
        return prompt


class CompletionReply(Reply):
    prefix = "cmpl-"

    def _make(self, choices: list[CompletionChoice], usage: CompletionUsage | None = None) -> Completion:
        return Completion(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)

    def _logprobs(self, tokens: Tokens) -> CompletionLogprobs | None:
        return self.logprobs.completion(list(tokens)) if self.logprobs is not None else None

    def whole(
        self, record: JobRecord, tokens: Tokens = (), prompt: Mapping[str, Any] | None = None
    ) -> BaseModel:
        """`prompt`: the job's `prompt` event (echo with logprobs)."""
        text, logprobs = record.text or "", None
        if self.echo is not None:
            text = self.echo + text
            logprobs = self._prompt_logprobs(prompt)
        logprobs = _joined(logprobs, self._logprobs(tokens))
        choice = CompletionChoice(
            index=self.index,
            text=text,
            finish_reason=record.finish_reason,
            logprobs=logprobs,
            prompt_token_ids=self.prompt_once(),
            token_ids=self.ids(tokens),
        )
        return self._make([choice], usage_of(record))

    def _prompt_logprobs(self, prompt: Mapping[str, Any] | None) -> CompletionLogprobs | None:
        if self.logprobs is None or prompt is None:
            return None
        return self.logprobs.prompt(self.echo_ids, prompt.get("prompt_logprobs") or [])

    def first(self, usage: CompletionUsage | None = None) -> BaseModel | None:
        """Echo without logprobs: the prompt's text first (with logprobs it waits for them)."""
        if self.echo is None or self.logprobs is not None:
            return None
        return self._make([CompletionChoice(index=self.index, text=self.echo)], usage)

    def echoed(self, data: Mapping[str, Any], usage: CompletionUsage | None = None) -> BaseModel | None:
        if self.echo is None or self.logprobs is None:
            return None
        logprobs = self._prompt_logprobs(data)
        return self._make([CompletionChoice(index=self.index, text=self.echo, logprobs=logprobs)], usage)

    def delta(self, text: str, usage: CompletionUsage | None = None, tokens: Tokens = ()) -> BaseModel:
        choice = CompletionChoice(
            index=self.index,
            text=text,
            logprobs=self._logprobs(tokens),
            prompt_token_ids=self.prompt_once(),
            token_ids=self.ids(tokens),
        )
        return self._make([choice], usage)

    def last(
        self, finish_reason: str | None, usage: CompletionUsage | None = None, tokens: Tokens = ()
    ) -> BaseModel:
        choice = CompletionChoice(
            index=self.index,
            text="",
            finish_reason=finish_reason,
            logprobs=self._logprobs(tokens),
            prompt_token_ids=self.prompt_once(),
            token_ids=self.ids(tokens),
        )
        return self._make([choice], usage)

    def usage(self, usage: CompletionUsage) -> BaseModel:
        return self._make([], usage)


class ChatReply(Reply):
    """`tools`: how the answer holds tool calls, when the request gave tools (and tool_choice is not
    `none`): they are read out of its text, whole or as it streams (`ToolCalls`)."""

    prefix = "chatcmpl-"

    def __init__(
        self,
        record: JobRecord,
        logprobs: TokenLogprobs | None = None,
        *,
        token_ids: bool = False,
        index: int = 0,
        echo: str | None = None,
        tools: ToolUse | None = None,
    ) -> None:
        super().__init__(record, logprobs, token_ids=token_ids, index=index, echo=echo)
        self.calls = ToolCalls(tools, record.id) if tools is not None else None

    def _chunk(self, choices: list[ChatChunkChoice], usage: CompletionUsage | None = None) -> BaseModel:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def _logprobs(self, tokens: Tokens) -> ChatLogprobs | None:
        return self.logprobs.chat(list(tokens)) if self.logprobs is not None else None

    def whole(
        self, record: JobRecord, tokens: Tokens = (), prompt: Mapping[str, Any] | None = None
    ) -> BaseModel:
        content: str | None = record.text or ""
        calls = None
        if self.calls is not None:
            content, calls = self.calls.whole(content or "")
        choice = ChatChoice(
            index=self.index,
            message=AssistantMessage(content=content, tool_calls=calls or None),
            finish_reason=_finish(record.finish_reason, bool(calls)),
            logprobs=self._logprobs(tokens) or (ChatLogprobs(content=[]) if self.logprobs else None),
            token_ids=self.ids(tokens),
        )
        return ChatCompletion(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[choice],
            usage=usage_of(record),
            prompt_token_ids=self.prompt_once(),
        )

    def first(self, usage: CompletionUsage | None = None) -> BaseModel | None:
        choice = ChatChunkChoice(
            index=self.index, delta=ChatDelta(role="assistant", content=""), token_ids=self.ids(())
        )
        return ChatCompletionChunk(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[choice],
            usage=usage,
            prompt_token_ids=self.prompt_once(),
        )

    def delta(self, text: str, usage: CompletionUsage | None = None, tokens: Tokens = ()) -> BaseModel | None:
        delta = ChatDelta(content=text)
        if self.calls is not None:
            content, calls = self.calls.feed(text)
            if not content and not calls:
                return None  # held: it may be part of a call (its tokens go with the next chunk)
            delta = ChatDelta(content=content or None, tool_calls=calls or None)
        choice = ChatChunkChoice(
            index=self.index, delta=delta, logprobs=self._logprobs(tokens), token_ids=self.ids(tokens)
        )
        return self._chunk([choice], usage)

    def last(
        self, finish_reason: str | None, usage: CompletionUsage | None = None, tokens: Tokens = ()
    ) -> BaseModel:
        delta = ChatDelta()
        if self.calls is not None:
            content, calls = self.calls.finish()
            delta = ChatDelta(content=content or None, tool_calls=calls or None)
            finish_reason = _finish(finish_reason, self.calls.called)
        choice = ChatChunkChoice(
            index=self.index,
            delta=delta,
            finish_reason=finish_reason,
            logprobs=self._logprobs(tokens),
            token_ids=self.ids(tokens),
        )
        return self._chunk([choice], usage)

    def usage(self, usage: CompletionUsage) -> BaseModel:
        return self._chunk([], usage)


def _finish(reason: str | None, called: bool) -> str | None:
    """OpenAI's `tool_calls` for an answer that ended by itself with calls."""
    return "tool_calls" if called and reason == "stop" else reason


def usage_of(record: JobRecord) -> CompletionUsage:
    prompt, completion = record.prompt_tokens or 0, record.completion_tokens or 0
    return CompletionUsage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


def _joined(head: CompletionLogprobs | None, tail: CompletionLogprobs | None) -> CompletionLogprobs | None:
    """Echo's prompt lists followed by the completion's."""
    if head is None or tail is None:
        return head or tail
    return CompletionLogprobs(
        text_offset=head.text_offset + tail.text_offset,
        token_logprobs=head.token_logprobs + tail.token_logprobs,
        tokens=head.tokens + tail.tokens,
        top_logprobs=head.top_logprobs + tail.top_logprobs,
    )
