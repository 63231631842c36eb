"""Every `curl` example in README.md, run against a live stack with the tiny model: each must answer
the HTTP status the README shows on the comment line under it (`# 202 {...}`)."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

import httpx
import pytest
from conftest import ROOT, start_stack

README = ROOT / "README.md"
SHOWN_HOST = "localhost:8000"
SHOWN_MODEL = "SmolLM2-135M-Instruct"


@dataclass
class Example:
    argv: list[str]
    status: int
    line: int


def shell_blocks(text: str) -> list[tuple[int, list[str]]]:
    """(first line number, lines) of every ```sh block."""
    blocks, current, start = [], None, 0
    for number, line in enumerate(text.splitlines(), 1):
        if current is None and line.strip() == "```sh":
            current, start = [], number + 1
        elif current is not None and line.strip() == "```":
            blocks.append((start, current))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def examples(text: str) -> list[Example | tuple[str, str]]:
    """The curl commands with the status shown under each, and `NAME=…` lines, in order."""
    found: list[Example | tuple[str, str]] = []
    for start, lines in shell_blocks(text):
        i = 0
        while i < len(lines):
            line = lines[i]
            if m := re.match(r"([A-Z_]+)=\S+", line):
                found.append((m.group(1), line))
            if not line.startswith("curl "):
                i += 1
                continue
            command, first = line, i
            while True:  # a command goes on over `\` and over a quoted body spanning lines
                try:
                    argv = shlex.split(command.replace("\\\n", " "), comments=True)
                    if not command.rstrip().endswith("\\"):
                        break
                except ValueError:
                    pass
                i += 1
                command += "\n" + lines[i]
            shown = re.match(r"# (\d{3})\b", lines[i + 1]) if i + 1 < len(lines) else None
            assert shown, f"README.md:{start + first}: a curl example must show its status on the next line"
            found.append(Example(argv, int(shown.group(1)), start + first))
            i += 1
    return found


def replay(client: httpx.Client, argv: list[str], variables: dict[str, str]) -> httpx.Response:
    """The request curl would send, sent with httpx."""
    method, headers, data, url = "GET", {}, None, None
    args = iter(argv[1:])
    for arg in args:
        if arg == "-H":
            name, _, value = next(args).partition(":")
            headers[name.strip()] = value.strip()
        elif arg in ("-d", "--data"):
            data, method = next(args), "POST" if method == "GET" else method
        elif arg == "-X":
            method = next(args)
        elif arg.startswith("-"):
            continue  # -s, -N, -i: how curl prints, not what it sends
        else:
            url = arg
    assert url is not None
    for name, value in variables.items():
        url = url.replace(f"${name}", value)
    path = url.removeprefix(SHOWN_HOST)
    content = data.replace(SHOWN_MODEL, "tiny").encode() if data is not None else None
    return client.request(method, path, headers=headers, content=content)


def test_the_readme_has_curl_examples_that_show_their_status() -> None:
    shown = [e for e in examples(README.read_text()) if isinstance(e, Example)]
    assert len(shown) >= 4
    assert all(e.argv[0] == "curl" and SHOWN_HOST in " ".join(e.argv) for e in shown)


@pytest.fixture(scope="module")
def readme_stack(tmp_path_factory, redis_url, tiny_model):  # type: ignore[no-untyped-def]
    stack = start_stack(
        tmp_path_factory.mktemp("readme"),
        redis_url=redis_url,
        models={"tiny": tiny_model},
        default_model="tiny",
        extra_env={"CONVEYOR_TORCH_THREADS": "1"},
    )
    yield stack
    stack.stop()


def test_every_curl_example_answers_the_status_it_shows(readme_stack) -> None:  # type: ignore[no-untyped-def]
    variables: dict[str, str] = {}
    last_id = ""
    ran = 0
    with readme_stack.client() as client:
        for example in examples(README.read_text()):
            if isinstance(example, tuple):  # JOB=<the id from the answer above>
                variables[example[0]] = last_id
                continue
            answer = replay(client, example.argv, variables)
            assert answer.status_code == example.status, (
                f"README.md:{example.line}: {shlex.join(example.argv)} answered {answer.status_code}, "
                f"the README shows {example.status}: {answer.text[:300]}"
            )
            if answer.status_code == 202:
                last_id = answer.json()["id"]
            ran += 1
    assert ran >= 4
