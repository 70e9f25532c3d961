"""The package's import graph stays layered: no cycle, no import that points up, no private name
used across modules.

The layers are the data flow of docs/design.md, bottom to top. A module may import its own layer
and the ones below; `engine` and `training` are siblings that never import each other (the
service joins them). Imports inside functions and under `TYPE_CHECKING` count: a lazy import
up a layer is still a dependency a reader must follow. The graph is read from the source with
`ast`, so nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# Bottom to top. A module belongs to the layer of its longest matching prefix.
LAYERS: list[tuple[str, ...]] = [
    (
        "art.errors",
        "art.numeric",
        "art.checks",
        "art.types",
        "art.naming",
        "art.metrics",
        "art.metrics_taxonomy",
        "art.costs",
        "art.base_models",
        "art._retry",
        "art.observability",
        "art.tracing",
        "art.devices",
        "art.weights",
        "art.runtime",
        "art.chat_template",
        "art.responses_format",
        "art.responses_events",
        "art.exchanges",
        "art.message_items",
        "art.messages_format",
        "art.exchange_turns",
        "art.exchange_tokens",
        "art.history_sources",
        "art.responses_calls",
        "art.histories",
        "art.completions_histories",
        "art.trajectory_histories",
        "art.tokenize",
        "art.trajectory_scopes",
        "art.rollout_runs",
    ),
    ("art.trajectories", "art.storage"),
    ("art.engine", "art.training"),
    ("art.service", "art.ray_cluster"),
    (
        "art.server",
        "art.capture",
        "art.capture_recorder",
        "art.capture_hooks",
        "art.gather",
        "art.gather_progress",
        "art.rewards",
        "art.model",
        "art.utils",
        "art.backends.base",
    ),
    ("art.dashboard", "art.pipeline_trainer", "art.verifiers", "art.langgraph", "art.mcp"),
    ("art.backends", "art.serve"),
    ("art.cli", "art.dev", "art.local", "art.backend", "art.__main__", "art"),
]
SIBLINGS = {("art.engine", "art.training"), ("art.training", "art.engine")}


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted((SRC / "art").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The `art` modules that module `name` imports, anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            # `from art import base_models` imports the module art.base_models, not `art`.
            submodules = [f"{source}.{alias.name}" for alias in node.names]
            targets = [m for m in submodules if m in known] or [source]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def layer_of(name: str) -> tuple[int, str]:
    best = (-1, "")
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > len(best[1]):
                best = (index, prefix)
    return best


GRAPH = {name: imports(name, path, modules()) for name, path in modules().items()}


def test_every_module_has_a_layer():
    assert [name for name in GRAPH if layer_of(name)[0] < 0] == []


def test_no_import_points_up_or_across():
    wrong = []
    for name, targets in GRAPH.items():
        (layer, group) = layer_of(name)
        for target in sorted(targets):
            (target_layer, target_group) = layer_of(target)
            if target_layer > layer or (group, target_group) in SIBLINGS:
                wrong.append(f"{name} (layer {layer}) imports {target} (layer {target_layer})")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle():
    state: dict[str, str] = {}
    cycles = []

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for target in sorted(GRAPH[name]):
            if state.get(target) == "open":
                cycles.append(" -> ".join([*path[path.index(target) :], target]))
            elif target not in state:
                visit(target, [*path, target])
        state[name] = "done"

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [name])
    assert not cycles, "\n".join(cycles)


LIBRARY_PRIVATES = {("art.capture_hooks", "_request")}
"""(module, attribute): a library's private name we must use, which one of ours happens to share
(aiohttp has no public hook for a session's requests: `ClientSession._request`)."""


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_definitions(tree: ast.AST) -> set[str]:
    """The private names a module defines: functions, classes, variables, `self._x` attributes."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                names.add(node.attr)
    return {name for name in names if is_private(name)}


def private_uses(name: str, tree: ast.AST, owners: dict[str, set[str]]) -> list[str]:
    """Where module `name` imports another module's private name, or reads or writes a private
    attribute that only other modules define (`group._items`, `trajectory._exchanges = ...`)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            found += [
                f"{name}:{node.lineno} imports {alias.name} from {node.module or '.'}"
                for alias in node.names
                if is_private(alias.name)
            ]
        elif isinstance(node, ast.Attribute) and is_private(node.attr) and (name, node.attr) not in LIBRARY_PRIVATES:
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            defined_in = owners.get(node.attr, set())
            if defined_in and name not in defined_in:
                found.append(f"{name}:{node.lineno} uses .{node.attr} of {', '.join(sorted(defined_in))}")
    return found


def test_no_module_uses_another_modules_private_names():
    """What modules share is public, with a docstring; a leading underscore means this module only."""
    trees = {name: ast.parse(path.read_text(), str(path)) for name, path in modules().items()}
    owners: dict[str, set[str]] = {}
    for name, tree in trees.items():
        for private in private_definitions(tree):
            owners.setdefault(private, set()).add(name)
    wrong = [line for name, tree in trees.items() for line in private_uses(name, tree, owners)]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(
    "source, caught",
    [
        ("from art.trajectories import _REPORTER\n", True),
        ("def f(group):\n    return group._items\n", True),
        ("def f(trajectory):\n    trajectory._items = []\n", True),
        ("class A:\n    def f(self):\n        return self._items\n", False),
        ("import os\nos._exit(1)\n", False),  # a library's private, not ours
    ],
)
def test_private_uses_are_found(source, caught):
    owners = {"_items": {"art.trajectories"}, "_REPORTER": {"art.trajectories"}}
    assert bool(private_uses("art.gather", ast.parse(source), owners)) == caught


@pytest.mark.parametrize(
    "source, expected",
    [
        ("from art import base_models\n", {"art.base_models"}),
        ("from art.engine.base import AdapterRef\n", {"art.engine.base"}),
        ("from . import loss\n", {"art.training.loss"}),
        ("def f():\n    import art.errors\n", {"art.errors"}),
    ],
)
def test_imports_are_read_as_a_reader_follows_them(tmp_path, source, expected):
    known = {name: Path() for name in ("art", "art.base_models", "art.engine.base", "art.errors")}
    known["art.training.loss"] = Path()
    path = tmp_path / "sequences.py"
    path.write_text(source)
    assert imports("art.training.sequences", path, known) == expected
