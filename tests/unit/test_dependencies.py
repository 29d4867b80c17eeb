"""The runtime dependencies in pyproject.toml are exactly the distributions node_agent imports:
nothing declared that is never imported, nothing imported that is not declared."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "node_agent"


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> set[str]:
    doc = tomllib.loads((ROOT / "pyproject.toml").read_text())
    names = set()
    for requirement in doc["project"]["dependencies"]:
        match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
        assert match is not None, requirement
        names.add(_normalize(match.group(1)))
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imported_modules(tree: ast.AST) -> set[str]:
    """Top-level names of every absolute import, lazy ones inside functions and
    ``importlib.import_module("literal")`` included; imports under ``if TYPE_CHECKING:`` do not
    count (they never run)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for branch in node.orelse:
                visit(branch)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
        elif (  # importlib.import_module("name"), with a literal name
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
            == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and not node.args[0].value.startswith(".")
        ):
            found.add(node.args[0].value.split(".")[0])
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def used() -> dict[str, set[str]]:
    """Distribution -> the modules of node_agent that import it."""
    dists = importlib.metadata.packages_distributions()
    out: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for top in imported_modules(tree):
            if top in sys.stdlib_module_names or top in ("node_agent", "__future__"):
                continue
            assert top in dists, f"{path.relative_to(ROOT)} imports {top!r}: not installed"
            for dist in dists[top]:
                out.setdefault(_normalize(dist), set()).add(str(path.relative_to(ROOT)))
    return out


def test_imports_are_found_lazily_and_type_checking_ones_ignored() -> None:
    tree = ast.parse(
        "import a.b\n"
        "from c import d\n"
        "from . import e\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import f\nelse:\n    import g\n"
        "def h():\n    import i\n"
        "importlib.import_module('j.k')\n"
    )
    assert imported_modules(tree) == {"a", "c", "typing", "g", "i", "j"}


def test_declared_dependencies_are_the_imported_ones() -> None:
    imports = used()
    undeclared = {d: sorted(where) for d, where in imports.items() if d not in declared()}
    unused = declared() - set(imports)
    assert (undeclared, unused) == ({}, set()), (
        f"imported but not declared in pyproject.toml: {undeclared}; "
        f"declared but never imported: {sorted(unused)}"
    )


def locked() -> dict[str, str]:
    """Distribution -> version pinned in packaging/requirements.lock (what the artifact holds)."""
    text = (ROOT / "packaging" / "requirements.lock").read_text()
    pins = re.findall(
        r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+) \\\n\s+--hash=sha256:[0-9a-f]{64}", text, re.M
    )
    return {_normalize(name): version for name, version in pins}


def test_every_declared_dependency_is_pinned_with_a_hash_in_the_lock() -> None:
    pins = locked()
    assert "aiohttp" in pins  # the pattern reads the file
    missing = sorted(declared() - set(pins))
    assert missing == [], f"declared in pyproject.toml but not pinned in the lock: {missing}"
