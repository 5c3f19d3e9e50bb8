"""A core install (``pip install dbtrigger``: SQLAlchemy only) asked for a name an extra brings.

``from dbtrigger import BlobCheckpointStore`` said only "No module named 'azure'"; the
README's table of extras is where the answer was. The error (still a
ModuleNotFoundError, as Python's own) names the extra to install.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import tomllib

BLOCK = textwrap.dedent(
    """
    import importlib.abc, sys

    class Absent(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path=None, target=None):
            if fullname.partition(".")[0] == {top!r}:
                raise ModuleNotFoundError(f"No module named {{fullname!r}}", name=fullname)
            return None

    sys.meta_path.insert(0, Absent())
    try:
        {statement}
    except ModuleNotFoundError as exc:
        print(type(exc).__name__, exc.name, exc, sep="|")
    """
)


def _import_without(top: str, statement: str) -> str:
    code = BLOCK.format(top=top, statement=statement)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    return done.stdout.strip()


@pytest.mark.parametrize(
    ("top", "statement", "extra"),
    [
        ("azure", "from dbtrigger import BlobCheckpointStore", "azure"),
        ("azure", "from dbtrigger import TableCheckpointStore", "azure"),
        ("azure", "from dbtrigger.state.stores import BlobCheckpointStore", "azure"),
        ("psycopg", "from dbtrigger.cdc import PgLogicalSource", "cdc"),
        ("pymysql", "from dbtrigger.cdc import BinlogSource", "binlog"),
    ],
)
def test_a_name_an_extra_brings_says_which_extra(top: str, statement: str, extra: str) -> None:
    kind, name, message = _import_without(top, statement).split("|")
    assert (kind, name.partition(".")[0]) == ("ModuleNotFoundError", top)
    assert message.endswith(f'which is not installed: pip install "dbtrigger[{extra}]"')


def test_a_name_of_the_core_still_imports_without_the_extras() -> None:
    statement = "from dbtrigger import FileCheckpointStore, PollTrigger, SqlAlchemySource"
    assert _import_without("azure", statement) == ""


def test_every_extra_named_exists_and_brings_the_module() -> None:
    from dbtrigger._lazy import EXTRAS  # noqa: PLC0415 - the fix's table, read here alone

    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    extras = project["optional-dependencies"]
    distributions = {"opentelemetry": "opentelemetry-api", "prometheus_client": "prometheus-client"}
    for module, extra in EXTRAS.items():
        wanted = distributions.get(module, module).replace("_", "-")
        listed = [r.split(">")[0].split("=")[0].split("[")[0].strip() for r in extras[extra]]
        assert any(name.startswith(wanted) for name in listed), (module, extra, listed)


def test_a_contract_suite_without_pytest_says_to_install_it() -> None:
    """testing.md's example on an install without pytest: "No module named 'pytest'"."""
    said = _import_without("pytest", "from dbtrigger.testing import StoreContract")
    kind, name, message = said.split("|")
    assert (kind, name) == ("ModuleNotFoundError", "pytest")
    assert message.startswith("StoreContract is a pytest suite")
    assert "pip install pytest" in message
    plain = "from dbtrigger.testing import MemorySource, CountingStore"
    assert _import_without("pytest", plain) == ""  # the fakes need no pytest


def test_every_extra_a_message_or_page_names_exists() -> None:
    """``pip install "dbtrigger[x]"`` is pasted from errors and docs: x must be an extra."""
    import re  # noqa: PLC0415

    root = Path(__file__).resolve().parent.parent
    project = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    extras = set(project["optional-dependencies"])
    files = [*(root / "src").rglob("*.py"), *(root / "docs").glob("*.md"), root / "README.md"]
    named = {
        (path.relative_to(root).as_posix(), extra)
        for path in files
        for group in re.findall(r"dbtrigger\[([a-z0-9_,-]+)\]", path.read_text(encoding="utf-8"))
        for extra in group.split(",")
    }
    assert len(named) > 10, "the install commands were not found"
    assert sorted((where, extra) for where, extra in named if extra not in extras) == []


def test_a_binlog_source_without_the_protocol_module_says_the_extra() -> None:
    """mysql-replication is imported at the first read: without it every tick
    failed with a bare ModuleNotFoundError. Building the source says it."""
    statement = textwrap.dedent(
        """
        from dbtrigger.cdc import BinlogSource
        from dbtrigger.errors import ConfigurationError
        try:
            BinlogSource("mysql+pymysql://root@127.0.0.1/shop", ["orders"])
        except ConfigurationError as exc:
            print("ConfigurationError", "", exc, sep="|")
        """
    ).replace("\n", "\n        ")
    kind, _, message = _import_without("pymysqlreplication", statement).split("|")
    assert kind == "ConfigurationError"
    assert message.endswith('pip install "dbtrigger[binlog]"'), message
