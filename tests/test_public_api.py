"""The public face: a small root, errors in ``dbtrigger.errors``, docs on public modules only.

``docs/api.md`` lists the public modules; every other module is internal.
What the README, the docs and the example import must come from a listed
module and be importable there without a warning, so a reader never copies an
import of an internal module (or of a name about to move).
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import re
import warnings
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest

import dbtrigger

ROOT = Path(__file__).resolve().parent.parent
API = ROOT / "docs" / "api.md"
CONTRACT_ERRORS = (
    "DbTriggerError",
    "LeaseAcquireError",
    "FetchError",
    "SerializationError",
    "HandlerError",
    "LostLeaseError",
    "CommitError",
)


@contextlib.contextmanager
def import_warnings_as_errors() -> Iterator[None]:
    """Warnings an import gives are errors; a ``ResourceWarning`` is not one of them.

    Earlier tests in the same process leave pooled connections for the garbage
    collector (a binding's engine lives as long as its app), and a collection that
    happens to run inside the block would turn their ``ResourceWarning`` into an
    unraisable error blamed on the import being checked: it is ignored. (Not a
    gc.collect() per import: in a worker that ran hundreds of tests that took 46 s.)
    """
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.simplefilter("ignore", ResourceWarning)
        yield


def public_modules() -> set[str]:
    """The modules the table of docs/api.md lists (its first column)."""
    text = API.read_text(encoding="utf-8")
    section = text.split("## The public modules", 1)[1]
    modules: set[str] = set()
    for line in section.splitlines():
        if line.startswith("| `dbtrigger"):
            first = line.split("|")[1]
            modules.update(re.findall(r"`(dbtrigger[\w.]*)`", first))
    return modules


def documented_code() -> list[tuple[str, str]]:
    """``(where, python source)`` of every code block of the README and docs, and the example."""
    blocks = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text(encoding="utf-8")
        for number, block in enumerate(re.findall(r"```python\n(.*?)```", text, re.S), 1):
            blocks.append((f"{page.relative_to(ROOT)} block {number}", block))
    for example in sorted((ROOT / "examples").rglob("*.py")):
        blocks.append((str(example.relative_to(ROOT)), example.read_text(encoding="utf-8")))
    return blocks


def imports_of(source: str) -> list[tuple[str, list[str]]]:
    """``(module, names)`` of each ``dbtrigger`` import in ``source`` (no names: ``import``).

    ``from dbtrigger.state import document`` imports the module
    ``dbtrigger.state.document``: it is reported as that module.
    """
    try:
        tree = ast.parse(source)
    except SyntaxError:  # a fragment: read the import lines alone
        lines = [ln.strip() for ln in source.splitlines()]
        imports = [ln for ln in lines if ln.startswith(("from ", "import ")) and "(" not in ln]
        tree = ast.parse("\n".join(imports))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dbtrigger"):
            names = []
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                if _is_module(submodule):
                    found.append((submodule, []))
                else:
                    names.append(alias.name)
            if names or not node.names:
                found.append((node.module, names))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name.startswith("dbtrigger")]
    return found


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def test_docs_and_examples_import_public_modules_only() -> None:
    public = public_modules()
    problems = []
    seen = 0
    for where, source in documented_code():
        for module, names in imports_of(source):
            seen += 1
            if module not in public:
                problems.append(f"{where}: {module} is internal (not in docs/api.md)")
                continue
            with import_warnings_as_errors():
                loaded = importlib.import_module(module)
                for name in names:
                    try:
                        getattr(loaded, name)
                    except (AttributeError, DeprecationWarning) as exc:
                        problems.append(f"{where}: from {module} import {name}: {exc}")
    assert seen > 20, "the extraction found almost no imports: is it still reading the docs?"
    assert not problems, "\n".join(problems)


def test_the_extraction_sees_an_internal_import() -> None:
    source = "from dbtrigger.runtime.poller import PollTrigger\nimport dbtrigger.sources.rows\n"
    modules = [m for m, _ in imports_of(source)]
    assert modules == ["dbtrigger.runtime.poller", "dbtrigger.sources.rows"]
    assert not set(modules) & public_modules()


@pytest.mark.parametrize("module", sorted(public_modules()))
def test_every_public_module_imports_without_a_warning(module: str) -> None:
    with import_warnings_as_errors():
        importlib.import_module(module)


def test_the_root_is_small_and_every_name_is_there() -> None:
    assert len(dbtrigger.__all__) <= 25
    with import_warnings_as_errors():
        for name in dbtrigger.__all__:
            assert getattr(dbtrigger, name) is not None
        for name in CONTRACT_ERRORS:  # the runtime contract names them as our API
            errors = importlib.import_module("dbtrigger.errors")
            assert getattr(dbtrigger, name) is getattr(errors, name)


def test_names_the_root_no_longer_offers_still_work_with_a_warning() -> None:
    from dbtrigger.errors import ConfigurationError  # noqa: PLC0415
    from dbtrigger.sources.visibility import SafetyWindow  # noqa: PLC0415

    with pytest.warns(DeprecationWarning, match="import it from dbtrigger.errors"):
        assert dbtrigger.ConfigurationError is ConfigurationError  # type: ignore[attr-defined]
    with pytest.warns(DeprecationWarning, match="dbtrigger.sources.visibility"):
        assert dbtrigger.SafetyWindow is SafetyWindow  # type: ignore[attr-defined]
    with pytest.raises(AttributeError):
        dbtrigger.NoSuchName  # type: ignore[attr-defined]  # noqa: B018


def test_version_comes_from_the_package_metadata() -> None:
    assert dbtrigger.__version__ == metadata.version("dbtrigger")


def test_the_contracts_names_are_exported_and_explained() -> None:
    """The runtime contract is written in these names: each is importable from the
    root and has a line in docs/api.md saying what it promises."""
    section = API.read_text(encoding="utf-8").split("## The names the runtime contract uses", 1)
    assert len(section) == 2, "docs/api.md lost its section on the contract's names"
    rows = {
        line.split("|")[1].strip(): line.split("|")[2].strip()
        for line in section[1].split("\n## ", 1)[0].splitlines()
        if line.startswith("| `")
    }
    named = {"db.trigger", "db.output", *CONTRACT_ERRORS[1:]}
    named |= {"PollTrigger", "SqlAlchemySource", "BlobCheckpointStore", "RowChange"}
    named |= {"DbOut", "MetricsCollector"}
    explained = {name for row in rows for name in re.findall(r"`([\w.]+)`", row)}
    assert named - explained == set()
    assert all(len(text) > 40 for text in rows.values()), "a name without its meaning"
    with import_warnings_as_errors():
        for name in named - {"db.trigger", "db.output"}:
            assert getattr(dbtrigger, name) is not None
        bindings = dbtrigger.DbBindings
        assert callable(bindings.trigger)
        assert callable(bindings.output)
