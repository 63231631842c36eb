"""Tools in the prompt: a chat template with a tools section renders the tools, the assistant's calls
and the `tool` messages itself (Qwen2.5, Qwen3, Llama 3.x, Mistral); for one without (SmolLM2,
Gemma, Phi-3, ...) they are written into the messages in the hermes format first (`written_in`):

- the tools, one JSON object a line within `<tools></tools>`, and how to call them, at the end of the
  system message (a system message is added when the chat has none);
- an assistant's calls after its text, one `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
  block each;
- `tool` messages as a `user` message of `<tool_response>\\n...\\n</tool_response>` blocks, one message
  for each run of them (templates that want roles to alternate take it).

Called by `ModelInfo.encode_chat` (app/api/catalog.py), on the API's tokenizing threads.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import jinja2
from jinja2 import meta

from app.api.toolformats import FORMATS, ToolFormat, format_of

TOOLS_PROMPT = """# Tools

You may call one or more functions to answer. Their definitions, one JSON object a line:
<tools>
{tools}
</tools>

To call a function, answer with one block per call, each a JSON object of the function's name and its \
arguments:
<tool_call>
{{"name": <function name>, "arguments": <the arguments as a JSON object>}}
</tool_call>"""


@cache
def has_tools_section(template: str) -> bool:
    """Whether the template reads a `tools` variable (parsed, not searched: a comment does not count)."""
    try:
        return "tools" in meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateSyntaxError:
        return False


def template_of(tokenizer: Any) -> str:
    """The template a chat with tools is rendered with ("" for a tokenizer without one)."""
    try:
        return str(tokenizer.get_chat_template(tools=[]))
    except ValueError:
        return ""


def template_format(tokenizer: Any) -> tuple[ToolFormat, bool]:
    """The format the model writes calls in, and whether its template renders tools itself."""
    template = template_of(tokenizer)
    if has_tools_section(template):
        return format_of(template), True
    return FORMATS["hermes"], False


def call_block(call: dict[str, Any]) -> str:
    function = call["function"]
    body = {"name": function["name"], "arguments": function["arguments"]}
    return f"<tool_call>\n{json.dumps(body, ensure_ascii=False)}\n</tool_call>"


def written_in(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """`messages` with the tools, the calls and the tool messages written into plain messages."""
    out: list[dict[str, Any]] = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("from_tools"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "from_tools": True})
            continue
        calls = message.get("tool_calls") or []
        if calls:
            content = "\n".join([*([content] if content else []), *(call_block(c) for c in calls)])
        out.append({"role": role, "content": content})
    for message in out:
        message.pop("from_tools", None)
    if tools:
        block = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{block}"}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out
