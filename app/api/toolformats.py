"""How each family's model writes a tool call, read back out of its text and forced by a grammar.

A format (`FORMATS`) is chosen by the model's chat template (`app.api.toolprompt.template_format`):

- `hermes`: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call, after
  any text (Qwen2.5, Qwen3, Hermes, SmolLM3, and every template without a tools section, which gets
  the tools in this format in its system prompt);
- `llama3_json`: the whole answer is `{"name": ..., "parameters": {...}}` (Llama 3.1 to 3.3), maybe
  after `<|python_tag|>`, several separated by `;`;
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` after any text (`[TOOL_CALLS]`
  is a special token: the job keeps special tokens in its text, `keeps_special_tokens`).

`parse` reads a text, whole or so far: the content before the calls, and each call's name and the
text of its arguments as the model wrote them, so that what a stream has sent of a call stays a
prefix of what the whole text gives (`app.api.toolcalls`). `grammar` is what `tool_choice`
`required` or a named function constrains the answer to: the format's own calls, nothing else.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from app.api.tool_schemas import ToolDefinition
from app.core.grammar import Grammar

# Calls a `required` answer may make at most with parallel_tool_calls (a small model can otherwise
# write calls until max_tokens).
MAX_PARALLEL_CALLS = 8
_DECODER = json.JSONDecoder()
_WS = re.compile(r"\s*")


class NotACall(ValueError):
    """The text has a call's opening but not a call (bad JSON, no name): it is the answer's content."""


@dataclass
class Call:
    name: str | None  # None until the text has it
    arguments: str  # the arguments object's text so far, exactly as written ("" before it starts)
    done: bool = False  # its text is complete


@dataclass
class Parsed:
    content: str  # the text before the calls that can no longer turn out to be part of one
    calls: list[Call] = field(default_factory=list)


def _ws(text: str, i: int) -> int:
    match = _WS.match(text, i)
    return match.end() if match else i


def _object(text: str, i: int, *, final: bool, keys: tuple[str, ...]) -> tuple[Call, int | None]:
    """The call whose JSON object starts at text[i]: its name and arguments as far as the text goes,
    and the index past its closing brace (None while it is open). NotACall where the text cannot be
    one (or, `final`, is not a whole one)."""
    call = Call(name=None, arguments="")
    if text[i : i + 1] != "{":
        raise NotACall("a call is a JSON object")
    i += 1
    seen_args = False
    while True:
        i = _ws(text, i)
        if i >= len(text):
            break
        if text[i] == "}":
            call.done = True
            if not seen_args:
                call.arguments = "{}"
            return call, i + 1
        if text[i] == ",":
            i = _ws(text, i + 1)
            if i >= len(text):
                break
        try:
            key, i = json.decoder.scanstring(text, i + 1) if text[i : i + 1] == '"' else (None, i)  # type: ignore[attr-defined]
        except ValueError:
            break  # the key's text is cut short
        if key is None:
            raise NotACall("a call's keys are strings")
        i = _ws(text, i)
        if i >= len(text):
            break
        if text[i] != ":":
            raise NotACall("a key without its value")
        start = _ws(text, i + 1)
        try:
            value, i = _DECODER.raw_decode(text, start)
        except ValueError:
            if key in keys and text[start : start + 1] == "{":  # arguments being written
                call.arguments, seen_args = text[start:], True
            break
        if key == "name":
            if not isinstance(value, str):
                raise NotACall("a call's name is a string")
            call.name = value
        elif key in keys:
            if not isinstance(value, dict):
                raise NotACall("a call's arguments are a JSON object")
            call.arguments, seen_args = text[start:i], True
    if final:
        raise NotACall("the call's JSON is cut short")
    return call, None


def _checked(call: Call, final: bool) -> Call:
    if (final or call.done) and (call.name is None or not call.done):
        raise NotACall("a call needs its name")
    return call


def _held(text: str, marker: str) -> str:
    """`text` less an end that could be the start of `marker` (a stream holds it back)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return text[:-size]
    return text


class ToolFormat:
    name = ""
    keys: tuple[str, ...] = ("arguments",)
    keeps_special_tokens = False  # the calls start with a special token the text must keep

    def parse(self, text: str, *, final: bool, forced: bool = False) -> Parsed:
        """The content and calls of `text` (a stream's text so far unless `final`). `forced`: the
        answer was constrained to calls (`grammar`). Raises NotACall."""
        raise NotImplementedError

    def grammar(self, tools: list[ToolDefinition], *, parallel: bool) -> Grammar:
        """Calls of these tools (one, or with `parallel` up to MAX_PARALLEL_CALLS), in this format."""
        raise NotImplementedError

    def _body(self, tools: list[ToolDefinition]) -> str:
        """One call of one of `tools`: a JSON schema in llguidance's Lark `%json`, compact."""
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": tool.function.name},
                    self.keys[0]: tool.function.arguments_schema(),
                },
                "required": ["name", self.keys[0]],
                "additionalProperties": False,
            }
            for tool in tools
        ]
        schema = {"x-guidance": {"whitespace_flexible": False}, "anyOf": calls}
        return "%json " + json.dumps(schema, separators=(",", ":"))


def _repeat(item: str, separator: str, parallel: bool) -> str:
    return f"{item} ({json.dumps(separator)} {item}){{0,{MAX_PARALLEL_CALLS - 1}}}" if parallel else item


class Hermes(ToolFormat):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def parse(self, text: str, *, final: bool, forced: bool = False) -> Parsed:
        at = text.find(self.OPEN)
        if at < 0:
            return Parsed(text if final else _held(text, self.OPEN))
        parsed = Parsed(text[:at])
        while at >= 0:
            start = at + len(self.OPEN)
            close = text.find(self.CLOSE, start)
            body = text[start:] if close < 0 else text[start:close]
            whole = final or close >= 0
            i = _ws(body, 0)
            if i == len(body):
                if whole:
                    raise NotACall("an empty tool call")
                parsed.calls.append(Call(None, ""))
                break
            call, _ = _object(body, i, final=whole, keys=self.keys)
            parsed.calls.append(_checked(call, whole))
            if close < 0:
                break
            at = text.find(self.OPEN, close + len(self.CLOSE))
        return parsed

    def grammar(self, tools: list[ToolDefinition], *, parallel: bool) -> Grammar:
        call = f'"{self.OPEN}\\n" body "\\n{self.CLOSE}"'
        return Grammar(
            "lark", f"start: {_repeat('call', chr(10), parallel)}\ncall: {call}\nbody: {self._body(tools)}\n"
        )


class Llama3Json(ToolFormat):
    name = "llama3_json"
    keys = ("parameters", "arguments")
    TAG = "<|python_tag|>"

    def parse(self, text: str, *, final: bool, forced: bool = False) -> Parsed:
        stripped = text.lstrip()
        i = len(text) - len(stripped)
        if stripped.startswith(self.TAG):
            i = _ws(text, i + len(self.TAG))
        elif not stripped.startswith("{"):
            if not final and (not stripped or self.TAG.startswith(stripped)):
                return Parsed("")  # nothing yet says whether it is a call
            return Parsed(text)
        parsed = Parsed("")
        while i < len(text):
            call, end = _object(text, i, final=final, keys=self.keys)
            parsed.calls.append(_checked(call, final))
            if end is None:
                break
            i = _ws(text, end)
            if text[i : i + 1] != ";":
                if final and i < len(text):
                    raise NotACall("text after the call")
                break
            i = _ws(text, i + 1)
        if final and not parsed.calls:
            raise NotACall("no call after the tag")
        return parsed

    def grammar(self, tools: list[ToolDefinition], *, parallel: bool) -> Grammar:
        return Grammar("lark", f"start: {_repeat('body', ';', parallel)}\nbody: {self._body(tools)}\n")


class Mistral(ToolFormat):
    name = "mistral"
    MARKER = "[TOOL_CALLS]"
    keeps_special_tokens = True

    def parse(self, text: str, *, final: bool, forced: bool = False) -> Parsed:
        at = 0 if forced else text.find(self.MARKER)
        if at < 0:
            return Parsed(text if final else _held(text, self.MARKER))
        parsed = Parsed(text[:at])
        i = _ws(text, at if forced else at + len(self.MARKER))
        if i >= len(text):
            if final:
                raise NotACall("no calls after the marker")
            return parsed
        if text[i] != "[":
            raise NotACall("the calls are a JSON list")
        i += 1
        while True:
            i = _ws(text, i)
            if i >= len(text) or text[i] == "]":
                if final and (i >= len(text) or not parsed.calls):
                    raise NotACall("the list of calls is cut short or empty")
                return parsed
            call, end = _object(text, i, final=final, keys=self.keys)
            parsed.calls.append(_checked(call, final))
            if end is None:
                return parsed
            i = _ws(text, end)
            if text[i : i + 1] == ",":
                i += 1
            elif text[i : i + 1] not in ("]", ""):
                raise NotACall("calls are separated by commas")

    def grammar(self, tools: list[ToolDefinition], *, parallel: bool) -> Grammar:
        return Grammar(
            "lark", f'start: "[" {_repeat("body", ",", parallel)} "]"\nbody: {self._body(tools)}\n'
        )


FORMATS: dict[str, ToolFormat] = {f.name: f for f in (Hermes(), Llama3Json(), Mistral())}


def format_of(template: str) -> ToolFormat:
    """The format a chat template with a tools section tells its model to write, by its marks; a
    template of no known format is read as hermes, the most common one."""
    if Mistral.MARKER in template:
        return FORMATS["mistral"]
    if Hermes.OPEN in template:
        return FORMATS["hermes"]
    if "<|eot_id|>" in template or Llama3Json.TAG in template:
        return FORMATS["llama3_json"]
    return FORMATS["hermes"]
