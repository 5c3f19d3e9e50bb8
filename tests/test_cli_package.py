"""The CLI is a package whose modules import each other in one direction only.

A cycle between command modules used to be broken by function-level imports
(``from dbtrigger.cli import load_object`` inside a function); this test keeps
the layering honest by reading the import statements, so a lazy import inside
a function counts as much as a top-level one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import dbtrigger

PACKAGE = Path(dbtrigger.__file__).parent


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def _cli_graph() -> dict[str, set[str]]:
    modules = {
        f"dbtrigger.cli.{p.stem}": p
        for p in (PACKAGE / "cli").glob("*.py")
        if p.stem not in ("__init__", "__main__")
    }
    return {name: _imports(path) & set(modules) for name, path in modules.items()}


def test_cli_modules_form_no_import_cycle() -> None:
    graph = _cli_graph()
    assert "dbtrigger.cli.main" in graph
    assert "dbtrigger.cli.loading" in graph
    visiting: list[str] = []
    done: set[str] = set()

    def visit(name: str) -> None:
        assert name not in visiting, "import cycle: " + " -> ".join([*visiting, name])
        if name in done:
            return
        visiting.append(name)
        for dep in sorted(graph[name]):
            visit(dep)
        visiting.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)


def test_no_cli_module_imports_the_package_front() -> None:
    """``dbtrigger.cli`` (the package) re-exports ``main``; importing it from below is a cycle."""
    for path in (PACKAGE / "cli").glob("*.py"):
        if path.stem in ("__init__", "__main__"):
            continue
        assert "dbtrigger.cli" not in _imports(path), path.name


def test_the_library_never_imports_the_cli() -> None:
    for path in PACKAGE.rglob("*.py"):
        if "cli" in path.relative_to(PACKAGE).parts:
            continue
        assert not any(m.startswith("dbtrigger.cli") for m in _imports(path)), path
