"""README.md and docs/quickstart.md, held to what they show.

Every `curl` example of both pages runs against a live stack with the tiny model: each must answer the
HTTP status shown on the comment line under it (`# 202 {...}`) and the shape shown there: every JSON
key it names, every literal value (`"status":"queued"`, `"object":"chat.completion"`, a value's fixed
prefix such as `"chatcmpl-…"`), the server-sent events it names. What the tiny random model cannot
share with SmolLM2 (the words, ids, token and latency numbers) is not compared; that SmolLM2 itself
answers "Paris" is `tests/e2e/test_stack.py::test_smollm2_knows_the_capital_of_france`.

The quickstart's `conveyor submit` runs against the same stack; every `conveyor` command line it
shows parses; the processes, ports and restart rules it states are the code's; `make run` is what the
README says. The auth recipe is `tests/e2e/test_auth_recipe.py`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import ROOT, start_stack
from typer.testing import CliRunner

# the README's commands
pytestmark = pytest.mark.e2e

README = ROOT / "README.md"
QUICKSTART = ROOT / "docs" / "quickstart.md"
PAGES = (README, QUICKSTART)
SHOWN_HOST = "localhost:8000"
SHOWN_MODEL = "SmolLM2-135M-Instruct"
# What the tiny random model (or the moment) decides, not the docs: its words, how it ended, ids.
VARIES = {"text", "finish_reason", "id"}
ENDED = {"succeeded", "failed", "cancelled", "expired"}


@dataclass
class Example:
    argv: list[str]
    status: int
    shown: str  # the comment lines under the command, the status included
    where: str


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


def examples(page: Path) -> list[Example | tuple[str, str]]:
    """The curl commands with what is shown under each, and the `JOB=<id>…` lines, in order."""
    found: list[Example | tuple[str, str]] = []
    for start, lines in shell_blocks(page.read_text()):
        i = 0
        while i < len(lines):
            line = lines[i]
            if m := re.match(r"([A-Z_]+)=\S+…\s", line):  # JOB=9f2c41d0…: the id answered above
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
            where = f"{page.relative_to(ROOT)}:{start + first}"
            shown_lines = []
            for after in lines[i + 1 :]:
                if not after.startswith("#"):
                    break
                shown_lines.append(after)
            status = re.match(r"# (\d{3})\b", shown_lines[0]) if shown_lines else None
            assert status, f"{where}: a curl example must show its status on the next line"
            found.append(Example(argv, int(status.group(1)), "\n".join(shown_lines), where))
            i += 1
    return found


def replay(
    client: httpx.Client, argv: list[str], variables: dict[str, str], *, key: str = "cvk_shown"
) -> httpx.Response:
    """The request curl would send, sent with httpx; `key` stands for the docs' `cvk_…` (an open
    stack ignores it)."""
    method, headers, data, url = "GET", {}, None, None
    args = iter(argv[1:])
    for arg in args:
        if arg == "-H":
            name, _, value = next(args).partition(":")
            headers[name.strip()] = value.strip().replace("cvk_…", key)
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


def walk(value: Any) -> Iterator[tuple[str, Any]]:
    """Every (key, value) of a JSON document, at any depth."""
    if isinstance(value, dict):
        for key, inner in value.items():
            yield key, inner
            yield from walk(inner)
    elif isinstance(value, list):
        for inner in value:
            yield from walk(inner)


def check_json(shown: str, answer: Any, where: str) -> None:
    """Every key shown is in the answer; every literal shown (a string, true, false, null) is the
    answer's value of that key somewhere; a string shown as `"prefix-…"` starts the answer's value."""
    pairs = list(walk(answer))
    keys = {k for k, _ in pairs}
    for key in re.findall(r'"(\w+)":', shown):
        assert key in keys, f"{where}: the answer has no {key!r}: {json.dumps(answer)[:400]}"
    for key, raw in re.findall(r'"(\w+)":("[^"…]*"|true|false|null)(?=[,}])', shown):
        if key not in VARIES:
            assert (key, json.loads(raw)) in pairs, f"{where}: {key} is not {raw}: {json.dumps(answer)[:400]}"
    for key, prefix in re.findall(r'"(\w+)":"([^"…]*[^\w"…])…"', shown):
        assert any(k == key and str(v).startswith(prefix) for k, v in pairs), f"{where}: {key} not {prefix}…"


def check_events(shown: str, body: str, where: str) -> None:
    """Every event name shown is in the stream; every key shown in a `token`'s data is in each token's."""
    events = re.findall(r"^event: (\w+)\ndata: (.*)$", body.replace("\r\n", "\n"), re.M)
    names = [name for name, _ in events]
    for name in re.findall(r"event: (\w+)", shown):
        assert name in names, f"{where}: no {name!r} event in {names}"
    assert names[-1] in {"done", "error", "cancelled", "expired"}, f"{where}: the stream did not end: {names}"
    for data in re.findall(r"event: token / data: (\{[^}]*\})", shown):
        for key in re.findall(r'"(\w+)":', data):
            assert all(key in json.loads(d) for n, d in events if n == "token"), f"{where}: token lacks {key}"


def wait_until_ended(client: httpx.Client, path: str) -> None:
    """A poll the docs show finished is made once the job has ended, as a reader would make it."""
    deadline = time.monotonic() + 60
    while client.get(path).json()["status"] not in ENDED:
        assert time.monotonic() < deadline, f"{path} did not end"
        time.sleep(0.1)


def test_the_pages_have_curl_examples_that_show_their_status() -> None:
    for page in PAGES:
        shown = [e for e in examples(page) if isinstance(e, Example)]
        assert len(shown) >= 3, page
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


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_curl_example_answers_what_it_shows(readme_stack, page) -> None:  # type: ignore[no-untyped-def]
    variables: dict[str, str] = {}
    last_id = ""
    ran = 0
    with readme_stack.client() as client:
        for example in examples(page):
            if isinstance(example, tuple):  # JOB=<the id from the answer above>
                variables[example[0]] = last_id
                continue
            shown = example.shown.replace(SHOWN_MODEL, "tiny")
            url = next(a for a in example.argv[1:] if SHOWN_HOST in a)
            if re.search(r'"status":"(succeeded|failed|cancelled|expired)"', shown):
                wait_until_ended(client, replace_vars(url, variables).removeprefix(SHOWN_HOST))
            answer = replay(client, example.argv, variables)
            assert answer.status_code == example.status, (
                f"{example.where}: {shlex.join(example.argv)} answered {answer.status_code}, "
                f"the page shows {example.status}: {answer.text[:300]}"
            )
            if answer.headers.get("content-type", "").startswith("text/event-stream"):
                check_events(shown, answer.text, example.where)
            else:
                check_json(shown, answer.json(), example.where)
            if answer.status_code == 202:
                last_id = answer.json()["id"]
                urls = answer.json()["urls"]  # "self" and "events" name this api's own address
                assert urls["self"] == f"{readme_stack.url}/v1/jobs/{last_id}", urls
                assert urls["events"] == f"{readme_stack.url}/v1/jobs/{last_id}/events", urls
            ran += 1
    assert ran >= 3


def replace_vars(text: str, variables: dict[str, str]) -> str:
    for name, value in variables.items():
        text = text.replace(f"${name}", value)
    return text


def test_the_quickstarts_conveyor_submit_streams_an_answer(readme_stack) -> None:  # type: ignore[no-untyped-def]
    """`.venv/bin/conveyor submit "…" --stream` as the quickstart shows it, against the api on its
    default address (here: the stack's port, through the setting that moves it)."""
    (line,) = [
        line for line in QUICKSTART.read_text().splitlines() if line.startswith(".venv/bin/conveyor submit")
    ]
    argv = shlex.split(line, comments=True)[1:]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env["CONVEYOR_API_PORT"] = readme_stack.url.rsplit(":", 1)[1]
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.startswith("job "), done.stderr  # the job id on stderr
    assert done.stdout.strip(), "no tokens printed"


def conveyor_lines() -> list[str]:
    """Every `conveyor …` command the quickstart shows (`a | b` lines: each), options' placeholders
    filled in."""
    found = []
    for _, lines in shell_blocks(QUICKSTART.read_text()):
        for line in lines:
            line = line.split("  #")[0].strip().removeprefix(".venv/bin/")
            if line.startswith("conveyor "):
                found += [part.strip() for part in line.split(" | ")]
    return [re.sub(r"[\[\]]", "", line).replace(" N", " 2") for line in found]


def test_every_conveyor_command_the_quickstart_shows_parses() -> None:
    from app.cli import cli

    lines = conveyor_lines()
    assert len(lines) >= 10
    for line in lines:
        args = shlex.split(line)[1:]
        parsed = CliRunner().invoke(cli, [*args, "--help"])  # parsing rejects an unknown option first
        assert parsed.exit_code == 0, f"`{line}`: {parsed.output[-400:]}"


def test_what_make_run_starts_is_what_the_pages_say(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The Makefile, and `conveyor up`'s defaults, against the README's and quickstart's words."""
    from app import launcher
    from app.core.config import DEFAULT_MODEL, Settings
    from app.stack import processes

    make_run = re.search(r"^run: .*?\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M)
    assert make_run is not None
    assert make_run.group(1).split("\n")[:4] == [
        "\t$(BIN)/conveyor model pull",
        # its one user, anonymous, sees all of /readyz and may use every class, as the tests' stacks
        "\tCONVEYOR_ADMIN_TENANTS=$${CONVEYOR_ADMIN_TENANTS:-'[\"anonymous\"]'} \\",
        "\tCONVEYOR_TENANT_PRIORITIES=$${CONVEYOR_TENANT_PRIORITIES:-"
        '\'{"anonymous": ["realtime", "high", "normal", "batch"]}\'} \\',
        "\tCONVEYOR_AUTH=$${CONVEYOR_AUTH:-none} $(BIN)/conveyor up",  # open unless CONVEYOR_AUTH is set
    ]
    for name in [n for n in os.environ if n.startswith("CONVEYOR_") or n == "REDIS_URL"]:
        monkeypatch.delenv(name)  # the defaults, as a fresh shell has them
    defaults = Settings()
    assert (defaults.api_port, defaults.embedded_redis_port, defaults.flower_port) == (8000, 6390, 5555)
    assert defaults.redis_url is None and defaults.flower and defaults.auth == "keys"
    children = [child.name for _, child in processes(defaults, [DEFAULT_MODEL], me=[], cores=2)]
    assert children == ["batcher", "webhooks", "callbacks", "stage0", "embed0"]
    quickstart = " ".join(QUICKSTART.read_text().split())
    for name in ("redis", "api", *children, "flower"):
        assert name in quickstart
    assert defaults.metrics_port == 9100
    assert f"metrics {children[0]} :9100, {children[1]} :9101, …" in quickstart
    # Ctrl-C: SIGTERM, then SIGKILL after 15 s; restarts at 0.5 s doubling to 8 s; a sixth death
    # within a minute stops the stack (`test_stack.py` kills a worker and sees it restarted).
    assert launcher.STOP_GRACE_S == 15 and "within 15 s" in quickstart
    assert (launcher.MAX_RESTARTS, launcher.RESTART_WINDOW_S) == (5, 60)
    assert "more than five times within a minute" in quickstart
    readme = " ".join(README.read_text().split())
    assert "one stage worker, one embeddings worker" in readme and defaults.stages == 1
    assert defaults.embedding_stages == 1


def test_the_api_pages_openai_example_runs(readme_stack) -> None:  # type: ignore[no-untyped-def]
    """docs/api.md's OpenAI example (greedy, `temperature=0`, then a stream with usage), run as shown
    with the official client against the stack."""
    text = (ROOT / "docs" / "api.md").read_text()
    code = text.split("## OpenAI-compatible API", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    code = code.replace("http://127.0.0.1:8000/v1", f"{readme_stack.url}/v1").replace(SHOWN_MODEL, "tiny")
    scope: dict[str, Any] = {}
    exec(compile(code, "docs/api.md", "exec"), scope)  # noqa: S102
    answer = scope["answer"]
    assert answer.object == "chat.completion" and answer.choices[0].message.role == "assistant"
    assert answer.usage.completion_tokens >= 1


def numbers(text: str) -> list[str]:
    return re.findall(r"(?<![\w.])\d+(?:\.\d+)?(?![\w.])", text)


def test_the_readmes_performance_figures_are_the_committed_results() -> None:
    """Each figure of the README's performance tables and GPU line is in the results file of the run
    it names: bench/results/peers.md (vLLM), suite.md (the naive server and Ray Serve), gpu.md."""
    section = README.read_text().split("## Performance", 1)[1].split("\n## ", 1)[0]
    tables = re.findall(r"((?:^\|.*\|\n)+)", section, re.M)
    assert len(tables) == 2
    gpu_line = section.split("On one NVIDIA H200", 1)[1].split("Every other run", 1)[0]
    for shown, results in (
        (tables[0], "peers.md"),
        (tables[1], "suite.md"),
        (gpu_line.split("--quick`)", 1)[1], "gpu.md"),
    ):
        committed = set(numbers((ROOT / "bench" / "results" / results).read_text()))
        body = "\n".join(line.split("|", 2)[-1] for line in shown.splitlines()[2:]) if "|" in shown else shown
        missing = [n for n in numbers(body) if n not in committed]
        assert not missing, f"README figures not in bench/results/{results}: {missing}"
