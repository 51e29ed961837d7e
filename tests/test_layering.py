"""The package's layering: no import circle between files, and core/ stands alone."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ppo_trainer"


def module_imports() -> dict[str, set[str]]:
    """Each plain module of ppo_trainer (package __init__ files left out) -> the plain modules it
    imports, at module level or inside functions alike."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name == "__init__.py":
            continue
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ppo_trainer"):
                targets |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name.startswith("ppo_trainer")}
        graph[name] = targets
    return {m: {t for t in targets if t in graph and t != m} for m, targets in graph.items()}


def test_no_import_circle_between_files():
    graph = module_imports()
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph[module]):
            assert state.get(target) != "open", "import circle: " + " -> ".join([*path, target])
            if target not in state:
                visit(target, [*path, target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_core_imports_nothing_from_the_rest_of_the_package():
    outside = {t for m, targets in module_imports().items() if m.startswith("ppo_trainer.core.")
               for t in targets if not t.startswith("ppo_trainer.core")}
    assert outside == set()
