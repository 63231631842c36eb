"""What the user docs claim to list completely, held against the code: every `conveyor` command and
option in docs/cli.md, every endpoint, error code and WebSocket close code in docs/api.md, every
repository path the README and docs/ name, and a JSON content type on every curl that sends a body."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer.main

import app.api.routes.ws as ws
from app.api.app import create_app
from app.api.errors import HTTP_CODES
from app.cli import cli
from app.core.config import Settings
from app.core.errors import ConveyorError

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CLI_MD = ROOT / "docs" / "cli.md"
API_MD = ROOT / "docs" / "api.md"


def commands(command: Any, path: tuple[str, ...] = ("conveyor",)) -> Iterator[tuple[str, set[str]]]:
    """Every leaf command of the CLI (`conveyor keys create`) with its long options, each as the
    option or, for a flag pair, either of its spellings (`--flower/--no-flower`)."""
    if hasattr(command, "list_commands"):
        for name in command.list_commands(None):
            yield from commands(command.get_command(None, name), (*path, name))
        return
    options = set()
    for param in command.params:
        spellings = [o for o in (*param.opts, *param.secondary_opts) if o.startswith("--")]
        if spellings:
            options.add("/".join(spellings))
    yield " ".join(path), options


def cli_md_rows(known: set[str]) -> dict[str, str]:
    """docs/cli.md's command tables: each row's command (the longest run of its first cell's words
    that names a command, else the cell's words up to the first option), its rows' text joined."""
    rows: dict[str, str] = {}
    for line in CLI_MD.read_text().splitlines():
        if m := re.match(r"\| `(conveyor [^`]*)` \|", line):
            words = m.group(1).split()
            named = [" ".join(words[:n]) for n in range(len(words), 1, -1) if " ".join(words[:n]) in known]
            name = named[0] if named else " ".join(w for w in words if not w.startswith(("-", "[")))
            rows[name] = rows.get(name, "") + line + " "
    return rows


def test_cli_md_lists_every_command_and_option() -> None:
    known = dict(commands(typer.main.get_command(cli)))
    rows = cli_md_rows(set(known))
    assert set(rows) == set(known), (
        f"missing from docs/cli.md: {sorted(set(known) - set(rows))}; "
        f"not a command: {sorted(set(rows) - set(known))}"
    )
    for name, options in known.items():
        for option in options:
            assert any(spelling in rows[name] for spelling in option.split("/")), (
                f"docs/cli.md: `{name}` does not show {option}"
            )


def routes(routes_: list[Any]) -> Iterator[Any]:
    for route in routes_:
        if hasattr(route, "original_router"):  # an included router
            yield from routes(route.original_router.routes)
        else:
            yield route


def shape(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "{}", path)


def test_api_md_lists_every_endpoint() -> None:
    app = create_app(Settings(redis_url="redis://127.0.0.1:1/0"))  # routes only: nothing connects
    served = set()
    for route in routes(app.router.routes):
        methods = sorted(set(getattr(route, "methods", None) or {"WS"}) - {"HEAD"})
        served |= {(method, shape(route.path)) for method in methods}
    listed = {
        (m.group(1), shape(m.group(2)))
        for m in re.finditer(r"^\| (GET|POST|WS|DELETE|PUT) \| `([^`]+)` \|", API_MD.read_text(), re.M)
    }
    listed.add(("GET", "/docs/oauth2-redirect"))  # Swagger UI's helper, named in the /docs row
    assert served == listed, (
        f"not in api.md: {sorted(served - listed)}; not served: {sorted(listed - served)}"
    )


def error_codes() -> set[str]:
    """Every code the API's error boundary can answer: the domain errors' codes, the HTTP layer's."""
    found, todo = set(), [ConveyorError]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.__module__.startswith(("app.core.registry", "app.core.modelstore")):
            continue  # `conveyor model add`'s refusals (source_not_found, package_untrusted): no route
        found.add(cls.code)
    return found | set(HTTP_CODES.values()) | {"http_error", "internal_error"}


def test_api_md_lists_every_error_code() -> None:
    import app.core.modelstore  # noqa: F401  (their errors are excluded by name, so import them for certain)
    import app.core.registry  # noqa: F401

    table = API_MD.read_text().split("| status | code | when |", 1)[1].split("\n\n", 1)[0]
    listed = set(re.findall(r"`([a-z_]+)`", table))
    missing = error_codes() - listed
    assert not missing, f"error codes missing from docs/api.md's table: {sorted(missing)}"


def test_api_md_lists_every_websocket_close_code() -> None:
    section = API_MD.read_text().split("## WebSocket", 1)[1]
    source = Path(ws.__file__).read_text()
    codes = {int(c) for c in re.findall(r"^[A-Z_]+ = (4\d{3})\b", source, re.M)}
    codes |= {int(c) for c in re.findall(r"status\.WS_(\d{4})_", source)}
    assert codes >= {4401, 4404, 4422, 4429, 1000, 1011, 1013}
    missing = {c for c in codes if str(c) not in section}
    assert not missing, f"WebSocket close codes missing from docs/api.md: {sorted(missing)}"


# A repository path: under one of its top-level folders, not a glob or a placeholder.
REPO_PATH = re.compile(r"(?<![\w./-])((?:app|tests|bench|docs|deploy)/[\w./-]*[\w/])(?![\w*{<-])")
NOT_PATHS = {"deploy/api"}  # `kubectl logs deploy/api`: a Deployment's name


# A path named with the commit that had it, later on its line (`bench/slice.py --quick` at commit
# 57abc94, `bench/slice.py` (commit 57abc94; ...), `bench/slice.py` measured it at commit 57abc94).
AT_COMMIT = re.compile(r"[^\n`]*`?[^\n`]*?(?:\bat commit|\(commit) ([0-9a-f]{7,40})\b")


def _existed_at(commit: str, path: str) -> bool:
    """`path` was in `commit`; true where this clone lacks that commit (a shallow clone)."""
    git = ["git", "-C", str(ROOT)]
    if subprocess.run([*git, "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True).returncode:
        return True
    return not subprocess.run([*git, "cat-file", "-e", f"{commit}:{path}"], capture_output=True).returncode


def test_every_repository_path_the_docs_name_exists() -> None:
    missing = []
    for page in PAGES:
        text = page.read_text()
        for m in REPO_PATH.finditer(text):
            path = m.group(1).split("::")[0]
            if path in NOT_PATHS or (ROOT / path).exists():
                continue
            then = AT_COMMIT.match(text, m.end())
            if then is None or not _existed_at(then.group(1), path):
                missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert not missing, missing


def test_every_curl_that_sends_a_body_says_it_is_json() -> None:
    """Without the header curl sends `application/x-www-form-urlencoded`, which the API refuses (422)."""
    wrong = []
    for page in PAGES:
        text = page.read_text().replace("\\\n", " ")
        for command in re.findall(r"^curl .*?(?=^\S|\Z)", text, re.M | re.S):
            if (
                re.search(r"\s(-d|--data)\s", command)
                and "content-type: application/json" not in command.lower()
            ):
                wrong.append(f"{page.relative_to(ROOT)}: {command.splitlines()[0]}")
    assert not wrong, wrong


def test_the_user_docs_speak_without_project_jargon() -> None:
    """`the seed` (the project's first specification) means nothing to a reader of the docs."""
    found = [
        f"{page.relative_to(ROOT)}" for page in PAGES if re.search(r"\bthe seed\b", page.read_text(), re.I)
    ]
    assert not found, found
