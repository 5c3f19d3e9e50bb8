"""The environment is read at the configuration edge only: ``dbtrigger.settings``.

Library objects take their configuration through constructors; ``%SETTING%``
references and the CLI's ``DBTRIGGER_*`` variables are read through
``dbtrigger.settings``. A read of ``os.environ`` (or ``os.getenv``) anywhere
else in the package is a second, undocumented configuration channel.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "dbtrigger"
EDGE = SRC / "settings.py"
#: What reads or writes the process environment.
ENVIRONMENT = frozenset({"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"})


def environment_reads(path: Path) -> list[str]:
    """``line: code`` of each use of the process environment in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in ENVIRONMENT
            and isinstance(node.value, ast.Name)
            and node.value.id in ("os", "posix", "nt")
        ):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom) and node.module in ("os", "posix", "nt"):
            names = [a.name for a in node.names if a.name in ENVIRONMENT]
            if names:
                found.append(f"{node.lineno}: from {node.module} import {', '.join(names)}")
    return found


def test_the_finder_sees_every_spelling(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import os\nfrom os import getenv\n"
        "a = os.environ['X']\nb = os.getenv('Y')\nc = os.environ.get('Z')\n"
        "d = {'environ': 1}['environ']\n",
        encoding="utf-8",
    )
    assert [r.split(":")[0] for r in environment_reads(sample)] == ["2", "3", "4", "5"]


@pytest.mark.parametrize(
    "path",
    sorted(p for p in SRC.rglob("*.py") if p != EDGE),
    ids=lambda p: str(p.relative_to(SRC)),
)
def test_no_module_but_settings_reads_the_environment(path: Path) -> None:
    reads = environment_reads(path)
    assert not reads, (
        f"{path.relative_to(SRC)} reads the process environment ({'; '.join(reads)}): "
        "take the value through a constructor, or read it with dbtrigger.settings "
        "(environment(), variable(), resolve_setting())"
    )


def test_the_edge_itself_is_where_the_environment_is_read() -> None:
    assert environment_reads(EDGE), "settings.py no longer reads the environment: update this test"


def test_a_missing_setting_says_where_to_set_it(tmp_path: Path) -> None:
    """`dbtrigger run app:trigger` with the README's `%ORDERS_DB_URL%` unset printed only
    "app setting 'ORDERS_DB_URL' is referenced but not set": not where a setting lives."""
    from dbtrigger.errors import MissingSettingError  # noqa: PLC0415
    from dbtrigger.settings import resolve_setting  # noqa: PLC0415

    with pytest.raises(MissingSettingError) as info:
        resolve_setting("%ORDERS_DB_URL%", environ={})
    message = str(info.value)
    assert message.startswith("app setting 'ORDERS_DB_URL' is referenced but not set: ")
    assert "environment variable ORDERS_DB_URL" in message
    assert "local.settings.json" in message
