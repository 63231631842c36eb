"""Layers point down: `core` <- `partitions` <- {`batching`, `workers`, `webhooks`} <- `api` <- the
command line (`app/cli.py`, `app/stack.py`, `app/launcher.py`). An import of a higher layer, or of a
sibling at the same height, makes the two impossible to change apart; this test finds every one in
`app/` (module level and inside functions) and fails on any not listed, with its reason, below."""

from __future__ import annotations

import ast
from pathlib import Path

APP = Path(__file__).resolve().parents[2] / "app"
RANK = {"core": 0, "partitions": 1, "batching": 2, "workers": 2, "webhooks": 2, "api": 3}
# the command line: imported by nothing below it
TOP = {"cli", "cli_common", "cli_up", "cli_models", "cli_keys", "cli_docs", "cli_batch", "stack", "launcher"}
# (module, imported) -> why it is still there. An entry no longer needed fails the test too.
ALLOWED: dict[tuple[str, str], str] = {}


def upward_imports() -> set[tuple[str, str]]:
    found = set()
    for path in sorted(APP.rglob("*.py")):
        relative = path.relative_to(APP)
        if len(relative.parts) < 2 or relative.parts[0] not in RANK:
            continue
        layer = relative.parts[0]
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            names += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                parts = name.split(".")
                if parts[0] != "app" or len(parts) < 2 or parts[1] == layer:
                    continue
                target = parts[1]
                if target in TOP or (target in RANK and RANK[target] >= RANK[layer]):
                    found.add((relative.as_posix(), name))
    return found


def test_no_module_imports_a_layer_above_or_beside_its_own() -> None:
    found = upward_imports()
    assert found - ALLOWED.keys() == set(), "imports that go up or sideways"
    assert ALLOWED.keys() - found == set(), "allowed imports that are gone: remove them from ALLOWED"


def test_a_model_s_kind_is_told_in_one_place() -> None:
    """Only `app.core.discovery.kind_of` compares a model's name with the embeddings model's: every
    other module asks it for the kind, so what a model is decides once, not in each caller."""
    found = []
    for path in sorted(APP.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(
                isinstance(n, ast.Name) and n.id == "EMBEDDING_MODEL" for n in [node.left, *node.comparators]
            ):
                found.append(f"{path.relative_to(APP)}:{node.lineno}")
    others = [f for f in found if not f.startswith("core/discovery.py:")]
    assert len(found) - len(others) == 1, "kind_of compares once"
    assert others == [], "compare kind_of(model) with EMBEDDING or GENERATION instead"
