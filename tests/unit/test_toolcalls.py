"""Tool calls' pure pieces: each family's template renders tools and calls in its own format, the
format is chosen by the template, and its parser reads back the calls the template wrote, whole and
as a stream's deltas; a template without a tools section gets them in the hermes format; a forced
answer's grammar accepts exactly the calls its parser reads.

The templates are small ones written here in each family's format (Qwen2.5/Qwen3's hermes blocks,
Llama 3.1's JSON with `parameters`, Mistral's `[TOOL_CALLS]` list): what matters of them is what they
write, not their wording."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from app.api.chat_schemas import ChatCompletionCreate
from app.api.tool_schemas import MessageToolCall, ToolDefinition
from app.api.toolcalls import ToolCalls, ToolUse
from app.api.toolformats import FORMATS, NotACall
from app.api.toolprompt import template_format, written_in
from app.core.grammar import grammar_problem
from app.workers.grammar import GrammarError, Grammars
from tests.tiny import CHAT_TEMPLATE, make_tokenizer

HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    '</tools>\nCall with <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call><|im_end|>\n{% endif %}'
    "{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n{% elif m.tool_calls %}<|im_start|>assistant\n{{ m.content }}"
    '{% for c in m.tool_calls %}\n<tool_call>\n{"name": "{{ c.function.name }}", "arguments": '
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3_TEMPLATE = (
    "<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython<|eot_id|>"
    "{% for m in messages %}{% if m.role == 'user' and tools and loop.first %}"
    '<|start_header_id|>user<|end_header_id|>\n\nRespond in the format {"name": function name, '
    '"parameters": dictionary of argument name and its value}.\n{% for t in tools %}{{ t | tojson }}\n'
    "{% endfor %}{{ m.content }}<|eot_id|>{% elif m.tool_calls %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
    '{% for c in m.tool_calls %}{"name": "{{ c.function.name }}", "parameters": '
    "{{ c.function.arguments | tojson }}}{% if not loop.last %}; {% endif %}{% endfor %}<|eot_id|>"
    "{% elif m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{% else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'user' %}{% if tools and loop.first %}[AVAILABLE_TOOLS]"
    "{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[INST]{{ m.content }}[/INST]"
    '{% elif m.tool_calls %}{{ m.content }}[TOOL_CALLS][{% for c in m.tool_calls %}{"name": '
    '"{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}{% if not loop.last %}, '
    "{% endif %}{% endfor %}]</s>{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]"
    "{% else %}{{ m.content }}</s>{% endif %}{% endfor %}"
)
END_OF_TURN = {"hermes": "<|im_end|>\n", "llama3_json": "<|eot_id|>", "mistral": "</s>"}
TEMPLATES = {"hermes": HERMES_TEMPLATE, "llama3_json": LLAMA3_TEMPLATE, "mistral": MISTRAL_TEMPLATE}

WEATHER = ToolDefinition.model_validate(
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
)
NOW = ToolDefinition.model_validate({"type": "function", "function": {"name": "now"}})
CALLS = [
    {"name": "get_weather", "arguments": {"city": 'Zürich "old" town', "days": 3}},
    {"name": "now", "arguments": {}},
]
USER = {"role": "user", "content": "Weather in Zürich, and the time?"}


def tokenizer_with(template: str) -> Any:
    tokenizer = make_tokenizer()
    tokenizer.chat_template = template
    return tokenizer


def assistant(calls: list[dict[str, Any]], content: str = "") -> dict[str, Any]:
    made = [
        MessageToolCall.model_validate(
            {"id": f"call_{i}", "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
        )
        for i, c in enumerate(calls)
    ]
    return {"role": "assistant", "content": content, "tool_calls": [m.for_template() for m in made]}


def answer_written_by(template: str, format_name: str, calls: list[dict[str, Any]], content: str = "") -> str:
    """What the template writes for an assistant's turn with these calls: the text a model trained on
    it answers with (its end-of-turn token ends the job, so it is not in the text)."""
    tokenizer = tokenizer_with(template)
    tools = [WEATHER.for_template(), NOW.for_template()]
    before = tokenizer.apply_chat_template([USER], tools=tools, add_generation_prompt=True, tokenize=False)
    if format_name == "mistral":  # its template opens no turn: the answer follows [/INST]
        before = tokenizer.apply_chat_template([USER], tools=tools, tokenize=False)
    whole = tokenizer.apply_chat_template([USER, assistant(calls, content)], tools=tools, tokenize=False)
    assert whole.startswith(before)
    text = whole[len(before) :]
    assert text.endswith(END_OF_TURN[format_name])
    return text[: -len(END_OF_TURN[format_name])]


def streamed(reader: ToolCalls, text: str, size: int) -> tuple[str, list[dict[str, Any]]]:
    """The stream's content and calls, added up from its deltas, as a client adds them."""
    content, calls = "", {}
    pieces = [reader.feed(text[i : i + size]) for i in range(0, len(text), size)] + [reader.finish()]
    for piece, deltas in pieces:
        content += piece
        for delta in deltas:
            d = delta.model_dump()
            if d["index"] not in calls:
                assert d["id"].startswith("call_") and d["type"] == "function" and "name" in d["function"]
                calls[d["index"]] = {"id": d["id"], "name": d["function"]["name"], "arguments": ""}
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
            calls[d["index"]]["arguments"] += d["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("format_name", list(TEMPLATES))
def test_each_template_is_read_with_its_own_format(format_name: str) -> None:
    assert template_format(tokenizer_with(TEMPLATES[format_name])) == (FORMATS[format_name], True)


def test_a_template_without_a_tools_section_gets_them_as_hermes_in_the_system_prompt() -> None:
    tokenizer = tokenizer_with(CHAT_TEMPLATE + "{# tools are not read here #}")
    assert template_format(tokenizer) == (FORMATS["hermes"], False)
    chat = [
        {"role": "system", "content": "Be brief."},
        USER,
        assistant(CALLS, content="Let me look."),
        {"role": "tool", "tool_call_id": "call_0", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_1", "content": "09:00"},
    ]
    messages = written_in(chat, [WEATHER.for_template()])
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert all(set(m) == {"role", "content"} for m in messages)
    system = messages[0]["content"]
    assert system.startswith("Be brief.\n\n# Tools") and json.dumps(WEATHER.for_template()) in system
    turn = messages[2]["content"]
    assert turn.startswith("Let me look.\n<tool_call>\n")
    content, calls = ToolCalls(ToolUse(FORMATS["hermes"]), "j").whole(turn)
    assert content == "Let me look." + "\n" and [c.function.name for c in calls] == ["get_weather", "now"]
    assert (
        messages[3]["content"]
        == "<tool_response>\nsunny\n</tool_response>\n<tool_response>\n09:00\n</tool_response>"
    )
    assert written_in([USER], [WEATHER.for_template()])[0]["role"] == "system", "a system message is added"


# Llama 3's calls are the whole answer: no text before them.
WRITTEN = [(f, "") for f in TEMPLATES] + [("hermes", "Checking. "), ("mistral", "Checking. ")]


@pytest.mark.parametrize(("format_name", "content"), WRITTEN, ids=[f"{f}-{bool(c)}" for f, c in WRITTEN])
def test_the_parser_reads_back_the_calls_its_template_writes(format_name: str, content: str) -> None:
    text = answer_written_by(TEMPLATES[format_name], format_name, CALLS, content)
    use = ToolUse(FORMATS[format_name])
    whole_content, calls = ToolCalls(use, "job").whole(text)
    assert (whole_content or "").strip() == content.strip()
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (c["name"], c["arguments"]) for c in CALLS
    ]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)

    for size in (1, 3, 17):  # a stream's pieces, however the text is cut, add up to the whole answer
        stream_content, stream_calls = streamed(ToolCalls(use, "job"), text, size)
        assert stream_content.strip() == content.strip()
        assert stream_calls == [
            {"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in calls
        ]


@pytest.mark.parametrize("format_name", list(TEMPLATES))
def test_a_plain_answer_or_a_call_cut_short_is_content(format_name: str) -> None:
    use = ToolUse(FORMATS[format_name])
    plain = "It is sunny in Zürich: 21 °C."
    assert ToolCalls(use, "j").whole(plain) == (plain, [])
    assert streamed(ToolCalls(use, "j"), plain, 4) == (plain, [])
    text = answer_written_by(TEMPLATES[format_name], format_name, CALLS[:1])
    cut = text[: text.index('"days"')]  # max_tokens ended it inside the call
    assert ToolCalls(use, "j").whole(cut) == (cut, [])
    with pytest.raises(NotACall):
        FORMATS[format_name].parse(cut, final=True)


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    text = answer_written_by(HERMES_TEMPLATE, "hermes", CALLS)
    _, calls = ToolCalls(ToolUse(FORMATS["hermes"], parallel=False), "j").whole(text)
    assert [c.function.name for c in calls] == ["get_weather"]
    assert [
        c["name"] for c in streamed(ToolCalls(ToolUse(FORMATS["hermes"], parallel=False), "j"), text, 5)[1]
    ] == ["get_weather"]


def consume(grammars: Grammars, tokenizer: Any, grammar: Any, text: str) -> bool:
    """Whether the grammar accepts `text` whole (consumed token by token, then complete)."""
    matcher = grammars.matcher(grammar)
    try:
        for token in tokenizer(text, add_special_tokens=False).input_ids:
            matcher.consume(token)
    except GrammarError:
        return False
    return bool(matcher.inner.is_accepting())


@pytest.mark.parametrize("format_name", list(TEMPLATES))
def test_a_forced_answers_grammar_accepts_the_calls_its_parser_reads_and_nothing_else(
    format_name: str,
) -> None:
    tokenizer = make_tokenizer()
    grammars = Grammars(tokenizer, eos_ids=frozenset({tokenizer.eos_token_id}), vocab_size=len(tokenizer))
    tool_format = FORMATS[format_name]
    grammar = tool_format.grammar([WEATHER, NOW], parallel=True)
    assert grammar_problem(grammar) is None
    key = tool_format.keys[0]
    one = {"name": "get_weather", key: {"city": "Oslo", "days": 2}}
    two = {"name": "now", key: {}}
    dumps = {"separators": (",", ":"), "ensure_ascii": False}
    texts = {
        "hermes": "\n".join(f"<tool_call>\n{json.dumps(c, **dumps)}\n</tool_call>" for c in (one, two)),  # type: ignore[arg-type]
        "llama3_json": ";".join(json.dumps(c, **dumps) for c in (one, two)),  # type: ignore[arg-type]
        "mistral": json.dumps([one, two], **dumps),  # type: ignore[arg-type]
    }
    text = texts[format_name]
    assert consume(grammars, tokenizer, grammar, text)
    _, calls = ToolCalls(ToolUse(tool_format, forced=True), "j").whole(text)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "days": 2}),
        ("now", {}),
    ]
    single = tool_format.grammar([WEATHER], parallel=False)
    assert not consume(grammars, tokenizer, single, text), "one call of the one tool only"
    for wrong in (
        text.replace("Oslo", 'Oslo", "x": "1'),
        text.replace('"days":2', '"days":"2"'),
        text.replace(",", ", "),
    ):
        assert not consume(grammars, tokenizer, grammar, wrong), wrong


CHAT = {"model": "m", "messages": [USER], "tools": [WEATHER.model_dump(), NOW.model_dump()]}


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "name"),
        ({"tools": [{"type": "retrieval", "function": {"name": "a"}}]}, "type"),
        (
            {"tools": [{"type": "function", "function": {"name": "a", "parameters": {"type": "array"}}}]},
            "type object",
        ),
        ({"tools": [WEATHER.model_dump(), WEATHER.model_dump()]}, "defined twice"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice needs tools"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "tool_call_id"),
        ({"messages": [{"role": "user", "content": None}]}, "needs its content"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "c", "type": "function", "function": {"name": "now", "arguments": "{"}}
                        ],
                    }
                ]
            },
            "not JSON",
        ),
    ],
)
def test_bad_tools_or_choices_are_refused_naming_the_problem(body: dict[str, Any], named: str) -> None:
    with pytest.raises(ValidationError) as caught:
        ChatCompletionCreate.model_validate({**CHAT, **body})
    assert named in str(caught.value)


def test_a_forced_choice_with_another_structured_output_or_uncompilable_parameters_is_refused() -> None:
    from app.core.errors import InvalidRequest

    both = ChatCompletionCreate.model_validate({**CHAT, "tool_choice": "required", "guided_regex": "a"})
    with pytest.raises(InvalidRequest, match="another structured output"):
        both.to_job()
    bad = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "strin"}}}},
    }
    broken = ChatCompletionCreate.model_validate({**CHAT, "tools": [bad], "tool_choice": "required"})
    with pytest.raises(InvalidRequest, match="parameters of 'f' cannot be compiled"):
        broken.to_job()


def test_tool_choice_decides_the_grammar_and_mistral_keeps_its_marker() -> None:
    auto = ChatCompletionCreate.model_validate(CHAT)
    assert auto.tool_mode == "auto" and auto.to_job().grammar is None
    assert auto.to_job().tools is not None and auto.to_job().skip_special_tokens
    assert not auto.to_job(FORMATS["mistral"]).skip_special_tokens, "[TOOL_CALLS] is a special token"
    none = ChatCompletionCreate.model_validate({**CHAT, "tool_choice": "none"})
    assert none.tool_use(FORMATS["hermes"]) is None and none.to_job().tools is not None
    named = ChatCompletionCreate.model_validate(
        {**CHAT, "tool_choice": {"type": "function", "function": {"name": "now"}}}
    )
    grammar = named.to_job().grammar
    assert grammar is not None and '"const":"now"' in grammar.text and "get_weather" not in grammar.text
