"""The configuration reference (docs/configuration.md), generated from `Settings`.

`conveyor docs config` writes it; tests/unit/test_config_doc.py checks that the committed page equals
what this module makes, so the page cannot drift from the code. Each field's description is the
comment written above it (up to the previous field or blank line) and beside it in
app/core/config.py, or in app/core/sections.py for the settings of a section (`Settings.webhook`,
`CONVEYOR_WEBHOOK_*`): the reason for a default lives next to the default, and only there.
"""

from __future__ import annotations

import ast
import inspect
import io
import json
import tokenize
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from app.core import config, sections
from app.core.config import Settings
from app.core.sections import SECTIONS

HEADER = """\
# Configuration reference

<!-- Generated from app/core/config.py by `conveyor docs config`; do not edit by hand. -->

Every process reads its settings from the environment when it starts, and only there
(`app/core/config.py`). Each variable is `CONVEYOR_` followed by the field's name in capitals, except
`REDIS_URL`. Lists and mappings are JSON (`CONVEYOR_MODELS='{{"name": "/path/to/model"}}'`), booleans
`true` / `false`. "unset" means the variable is absent; the description says what that does.

{count} settings, in the order of the source.

| variable | type | default | what it does, and why this default |
|---|---|---|---|
"""


@dataclass(frozen=True)
class Row:
    env: str
    type: str
    default: str
    description: str


def env_name(name: str, field: FieldInfo, section: str = "") -> str:
    """The variable a field is read from: its alias, else the prefix, its section's name and its
    own, in capitals."""
    if isinstance(field.validation_alias, str):
        return field.validation_alias
    prefix = str(Settings.model_config.get("env_prefix", ""))
    return (prefix + (section + "_" if section else "") + name).upper()


def default_text(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value: Any = field.default_factory()  # type: ignore[call-arg]
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if isinstance(value, Enum):
        value = value.value
    if isinstance(value, Path):
        value = str(value)
    if isinstance(value, list | dict):
        return f"`{json.dumps(value, default=str)}`"
    return f"`{value}`"


def _comments(source: str) -> dict[int, str]:
    """Line number -> the text of the comment on that line."""
    found = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            found[token.start[0]] = token.string.lstrip("#").strip()
    return found


def _descriptions(source: str, name: str) -> dict[str, tuple[str, str]]:
    """Field name of the class `name` in `source` -> (its annotation as written, its description
    from the comments)."""
    tree = ast.parse(source)
    comments = _comments(source)
    lines = source.splitlines()
    (cls,) = (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    found = {}
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above: list[str] = []
        line = node.lineno - 1
        while line >= 1 and lines[line - 1].strip().startswith("#"):
            above.insert(0, comments[line])
            line -= 1
        beside = [
            comments[n] for n in range(node.lineno, (node.end_lineno or node.lineno) + 1) if n in comments
        ]
        annotation = ast.get_source_segment(source, node.annotation) or ""
        found[node.target.id] = (annotation, " ".join(above + beside))
    return found


def rows() -> list[Row]:
    """One row a setting, in the order of the source; a section's settings where `Settings` holds it."""
    described = _descriptions(inspect.getsource(config), Settings.__name__)
    source = inspect.getsource(sections)
    table = []
    for name, field in Settings.model_fields.items():
        if name in SECTIONS:
            model = SECTIONS[name]
            inner = _descriptions(source, model.__name__)
            for setting, info in model.model_fields.items():
                annotation, description = inner.get(setting, ("", ""))
                table.append(Row(env_name(setting, info, name), annotation, default_text(info), description))
            continue
        annotation, description = described.get(name, ("", ""))
        table.append(Row(env_name(name, field), annotation, default_text(field), description))
    return table


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    """The whole page, as committed in docs/configuration.md."""
    table = rows()
    body = "".join(
        f"| `{r.env}` | `{_cell(r.type)}` | {_cell(r.default)} | {_cell(r.description)} |\n" for r in table
    )
    return HEADER.format(count=len(table)) + body
