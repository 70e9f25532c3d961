"""The package's import graph stays layered: no cycle, no import that points up.

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
        "art.chat_template",
        "art.responses_format",
        "art.exchanges",
        "art.messages_format",
        "art.exchange_turns",
        "art.exchange_tokens",
        "art.history_sources",
        "art.histories",
        "art.tokenize",
    ),
    ("art.trajectories", "art.storage"),
    ("art.engine", "art.training"),
    ("art.service", "art.ray_cluster"),
    ("art.server", "art.capture", "art.gather", "art.rewards", "art.model", "art.utils", "art.backends.base"),
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
