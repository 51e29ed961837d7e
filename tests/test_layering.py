"""The package's layering as docs/architecture.md draws it: `LAYERS`, top to bottom; a module imports
from its own layer and those below, never from one above; and no import circle between files."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Mapping

PACKAGE = Path(__file__).resolve().parents[1] / "ppo_trainer"

# Top to bottom. An entry is a module or a package (with everything in it), relative to ppo_trainer.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("entry points", ("cli", "serve_reward", "sweep_report")),
    ("driver", ("trainer", "evaluate", "plan", "run.trainer_state", "run.pipeline", "run.filtering", "rm")),
    ("workers", ("workers",)),
    ("engines, samplers, agents, rewards, data", ("engine", "rollout", "agents", "rewards", "data")),
    ("models", ("models",)),
    ("shared", ("config", "run", "batch", "dtypes", "tracking", "console", "errors")),
    ("core", ("core",)),
)


def module_name(path: Path) -> str:
    """ppo_trainer/engine/fsdp.py -> "ppo_trainer.engine.fsdp"; a package's __init__.py -> the package."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(tree: ast.AST, known: set[str]) -> set[str]:
    """The ppo_trainer modules and packages `tree` imports, at module level or inside functions alike:
    `from ppo_trainer.x import y` is the module x.y where y is one (a package's submodule), else x."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "ppo_trainer":
            found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                      for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "ppo_trainer"}
    return found


def import_graph() -> dict[str, set[str]]:
    """Each module and package of ppo_trainer (the root package left out) -> what it imports of ppo_trainer."""
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    paths.pop("ppo_trainer")
    known = set(paths)
    return {m: imported_modules(ast.parse(p.read_text()), known) - {m} for m, p in paths.items()}


def layer_of(module: str) -> int | None:
    """The index in `LAYERS` of the module or package `module` (0 is the top), None if no layer lists it."""
    rest = module.removeprefix("ppo_trainer.")
    for index, (_, entries) in enumerate(LAYERS):
        if any(rest == e or rest.startswith(e + ".") for e in entries):
            return index
    return None


def upward_imports(graph: Mapping[str, set[str]]) -> list[str]:
    """"module (layer) -> target (layer)" for every import of a module from a layer above its own."""
    return [f"{m} ({LAYERS[layer_of(m)][0]}) -> {t} ({LAYERS[layer_of(t)][0]})"
            for m, targets in sorted(graph.items()) for t in sorted(targets) if layer_of(t) < layer_of(m)]


def test_every_module_has_a_layer():
    assert [m for m in sorted(import_graph()) if layer_of(m) is None] == [], \
        "place each new module in LAYERS (tests/test_layering.py) and in docs/architecture.md's Layers"


def test_no_module_imports_from_a_layer_above_its_own():
    assert upward_imports(import_graph()) == []


def test_an_import_from_a_layer_above_is_reported_with_both_layers():
    graph = {"ppo_trainer.engine.fsdp": {"ppo_trainer.workers.cluster.placement", "ppo_trainer.models.actor"},
             "ppo_trainer.core.gae": {"ppo_trainer.config.schema"}}
    assert upward_imports(graph) == [
        "ppo_trainer.core.gae (core) -> ppo_trainer.config.schema (shared)",
        "ppo_trainer.engine.fsdp (engines, samplers, agents, rewards, data) -> ppo_trainer.workers.cluster.placement (workers)",
    ]


def test_a_package_import_names_the_submodule_where_there_is_one():
    known = {"ppo_trainer.rollout", "ppo_trainer.rollout.vllm", "ppo_trainer.data", "ppo_trainer.run",
             "ppo_trainer.run.checkpoint"}
    tree = ast.parse("from ppo_trainer.rollout import build_sampler, vllm\nfrom ppo_trainer.run import checkpoint\n"
                     "def f():\n    from ppo_trainer.data import PromptLoader\n")
    assert imported_modules(tree, known) == {"ppo_trainer.rollout", "ppo_trainer.rollout.vllm",
                                             "ppo_trainer.run.checkpoint", "ppo_trainer.data"}


def test_no_import_circle_between_files():
    graph = {m: {t for t in targets if (PACKAGE.parent / t.replace(".", "/")).with_suffix(".py").is_file()}
             for m, targets in import_graph().items()
             if (PACKAGE.parent / m.replace(".", "/")).with_suffix(".py").is_file()}
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
