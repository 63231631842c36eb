"""An answer's tool calls, read out of its text by the model's format (`app.api.toolformats`): all at
once (`ToolCalls.whole`), or as its stream goes (`feed`, then `finish`), in OpenAI's chunks.

A stream sends content as soon as it cannot be the start of a call; a call's first delta as soon as
its name is written (index, id, type, name, and its arguments so far), then each new piece of its
arguments' text. What the stream sends adds up to what `whole` gives for the same text. A text whose
call does not parse (cut short by max_tokens, bad JSON) is content, as vLLM answers it.

Used by `ChatReply` (app/api/openai_replies.py), one per answer.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from app.api.openai_answers import FunctionCall, FunctionCallDelta, ToolCall, ToolCallDelta
from app.api.toolformats import Call, NotACall, Parsed, ToolFormat


@dataclass(frozen=True)
class ToolUse:
    """How a request's answer holds calls: the model's format; `forced` when tool_choice constrained
    it to calls (required, or a named function); `parallel` (parallel_tool_calls) keeps every call
    of an `auto` answer, else only the first."""

    format: ToolFormat
    forced: bool = False
    parallel: bool = True


def call_id(job_id: str, index: int) -> str:
    """The same call of the same job has the same id, whoever reads it (a stream, a batch's output)."""
    return "call_" + hashlib.sha256(f"{job_id}:{index}".encode()).hexdigest()[:24]


class ToolCalls:
    def __init__(self, use: ToolUse, job_id: str) -> None:
        self.use = use
        self.job_id = job_id
        self.text = ""
        self.content_sent = 0  # characters of content sent
        self.arguments_sent: list[
            int
        ] = []  # per call whose first delta is out: its arguments' characters sent

    def _parse(self, text: str, *, final: bool) -> Parsed:
        parsed = self.use.format.parse(text, final=final, forced=self.use.forced)
        if not self.use.parallel:
            parsed.calls = parsed.calls[:1]
        return parsed

    def whole(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The content (None when it calls tools and says nothing) and the calls of a whole answer."""
        try:
            parsed = self._parse(text, final=True)
        except NotACall:
            return text, []
        calls = [
            ToolCall(
                id=call_id(self.job_id, k), function=FunctionCall(name=c.name or "", arguments=c.arguments)
            )
            for k, c in enumerate(parsed.calls)
        ]
        content = parsed.content if parsed.content.strip() or not calls else None
        return content, calls

    @property
    def called(self) -> bool:
        """A call's first delta has been sent."""
        return bool(self.arguments_sent)

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """The content and call deltas that `text`, the next piece of the answer, lets out."""
        self.text += text
        try:
            parsed = self._parse(self.text, final=False)
        except NotACall:  # not a call after all: it is content, let out at the end
            return "", []
        return self._new(parsed)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """What is left to send once the answer is whole."""
        try:
            parsed = self._parse(self.text, final=True)
        except NotACall:
            parsed = Parsed(self.text if not self.called else "")
            if self.called:
                return "", []
        return self._new(parsed)

    def _new(self, parsed: Parsed) -> tuple[str, list[ToolCallDelta]]:
        content = parsed.content[self.content_sent :]
        self.content_sent = max(self.content_sent, len(parsed.content))
        deltas = []
        for index, call in enumerate(parsed.calls):
            if call.name is None:
                break  # its first delta waits for its name; the calls after it for it
            deltas.extend(self._call_deltas(index, call))
        return content, deltas

    def _call_deltas(self, index: int, call: Call) -> list[ToolCallDelta]:
        if index == len(self.arguments_sent):
            self.arguments_sent.append(len(call.arguments))
            function = FunctionCallDelta(name=call.name, arguments=call.arguments)
            return [
                ToolCallDelta(index=index, id=call_id(self.job_id, index), type="function", function=function)
            ]
        more = call.arguments[self.arguments_sent[index] :]
        if not more:
            return []
        self.arguments_sent[index] = len(call.arguments)
        return [ToolCallDelta(index=index, function=FunctionCallDelta(arguments=more))]
