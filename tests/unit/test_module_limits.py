"""Limits that keep `app/` a place to live in, so they cannot creep back: no module over 500 lines, no
circle of imports (every import counts: at module level, under TYPE_CHECKING, inside a function),
and no more settings than today (one row each in docs/configuration.md). An exception listed here
that no longer holds fails the test too, so the list only shrinks."""

from __future__ import annotations

import ast
from pathlib import Path

from app.core.config_doc import rows

APP = Path(__file__).resolve().parents[2] / "app"
MAX_LINES = 500
MAX_SETTINGS = 70  # 126, less knobs nobody tuned, that measured no gain, or that another derives
# module -> why it is still longer than MAX_LINES.
LONGER: dict[str, str] = {}
# modules of a circle -> why it is still there.
CIRCLES: dict[frozenset[str], str] = {}


def module_name(path: Path) -> str:
    parts = ("app", *path.relative_to(APP).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    """Module -> the modules of `app` it imports, wherever in it."""
    modules = {module_name(path): path for path in APP.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
            elif isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def circles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: set[frozenset[str]] = set()

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = set()
            while not component or module not in component:
                component.add(stack.pop())
            if len(component) > 1:
                found.add(frozenset(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_no_module_of_app_is_over_500_lines() -> None:
    lengths = {
        path.relative_to(APP).as_posix(): len(path.read_text().splitlines()) for path in APP.rglob("*.py")
    }
    assert {m: n for m, n in lengths.items() if n > MAX_LINES and m not in LONGER} == {}, "split these"
    assert {m for m in LONGER if lengths.get(m, 0) <= MAX_LINES} == set(), (
        "no longer long: remove from LONGER"
    )


def test_the_settings_module_stays_small() -> None:
    """Settings are declared once (sections in app/core/sections.py): config.py holds no mirror."""
    assert len((APP / "core" / "config.py").read_text().splitlines()) <= 450


def test_no_circle_of_imports_in_app() -> None:
    found = circles(imports())
    assert found - CIRCLES.keys() == set(), "modules that import each other, directly or round about"
    assert CIRCLES.keys() - found == set(), "circles that are gone: remove them from CIRCLES"


def test_the_circle_finder_sees_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == {frozenset({"a", "b", "c"})}
    assert circles({"a": {"b"}, "b": set()}) == set()


def test_the_settings_do_not_grow() -> None:
    """Every setting is a row of the reference page; a new one takes the place of an old one."""
    assert len(rows()) <= MAX_SETTINGS
