"""The house rules of ``node_agent``: every import runs down the layers, and no module imports
itself back through others (type-only and function-level imports included).

A newcomer finds a part by its folder; these rules keep each folder's job where it is: the pure
OSC core and the base stand alone, seams never reach into controllers, the read side only reads.
The test fails on a new upward import or cycle and names it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import node_agent

ROOT = Path(node_agent.__file__).parent

#: Lowest first. A module may import its own layer and every layer below it, never one above.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("node_agent", "node_agent.base")),
    ("osc core", ("node_agent.osc",)),
    ("config", ("node_agent.config",)),
    (
        "seams",
        ("node_agent.host", "node_agent.systemd", "node_agent.kube", "node_agent.containerd"),
    ),
    ("apply", ("node_agent.apply",)),
    ("context", ("node_agent.context",)),
    ("controllers", ("node_agent.controllers",)),
    ("read side", ("node_agent.observe",)),
    ("wiring", ("node_agent.agent",)),
    ("commands", ("node_agent.commands", "node_agent.cli", "node_agent.__main__")),
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> int:
    best, best_len = -1, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            matches = module == prefix or module.startswith(prefix + ".")
            if matches and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    assert best >= 0, f"{module} is in no layer: add its folder to LAYERS"
    return best


def imports_of(path: Path, module: str) -> Iterator[str]:
    """Every node_agent module ``path`` imports, anywhere in the file."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("node_agent"):
                    yield alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            if not base.startswith("node_agent"):
                continue
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                yield candidate if candidate in MODULES else base


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}
GRAPH = {name: sorted(set(imports_of(path, name)) - {name}) for name, path in MODULES.items()}


def test_every_module_is_in_a_layer() -> None:
    for name in MODULES:
        layer_of(name)


def test_no_import_runs_up_a_layer() -> None:
    upward = [
        f"{name} ({LAYERS[layer_of(name)][0]}) imports {dep} ({LAYERS[layer_of(dep)][0]})"
        for name, deps in GRAPH.items()
        for dep in deps
        if dep != "node_agent" and layer_of(dep) > layer_of(name)
    ]
    assert upward == []


def test_the_osc_core_and_the_base_import_nothing_above_them() -> None:
    for name, deps in GRAPH.items():
        if layer_of(name) <= 1:
            assert all(layer_of(dep) <= layer_of(name) for dep in deps), (name, deps)


def cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative enough here)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for dep in GRAPH.get(node, []):
            if dep not in MODULES or dep == "node_agent":
                continue
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for name in sorted(MODULES):
        if name not in index:
            visit(name)
    return found


def test_no_import_cycles() -> None:
    assert cycles() == []


def test_the_checker_sees_an_upward_import_and_a_cycle() -> None:
    """The rules above must be able to fail: a made-up graph with both faults is caught."""
    saved = dict(GRAPH)
    try:
        GRAPH["node_agent.base.errors"] = ["node_agent.agent"]
        GRAPH["node_agent.agent"] = [*GRAPH["node_agent.agent"], "node_agent.base.errors"]
        assert any("node_agent.base.errors" in cycle for cycle in cycles())
        assert layer_of("node_agent.agent") > layer_of("node_agent.base.errors")
    finally:
        GRAPH.clear()
        GRAPH.update(saved)
