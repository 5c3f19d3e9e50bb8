"""``dbtrigger check`` on a log-based source watching a table that is not there.

A BinlogSource reported it as ``privileges``, with a ``GRANT SELECT`` for an
account that could read everything (root); a PgLogicalSource as
``source_access``. Both now say ``tables``: the table does not exist, create it
or correct ``tables=``.
"""

from __future__ import annotations

import textwrap
import uuid
from pathlib import Path

import pytest

from dbtrigger.cli import main
from tests.cdc_servers import BinlogDatabase, CdcDatabase

pytestmark = pytest.mark.timeout(180)


def check(
    root: Path, source: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> tuple[int, str]:
    module = f"cdcmissing_{uuid.uuid4().hex[:8]}"
    (root / f"{module}.py").write_text(
        textwrap.dedent(
            f"""
            from dbtrigger import FileCheckpointStore, PollTrigger
            from dbtrigger.cdc import BinlogSource, PgLogicalSource

            trigger = PollTrigger(
                name="orders", source={source}, checkpoint_store=FileCheckpointStore("state")
            )
            """
        )
    )
    monkeypatch.chdir(root)
    monkeypatch.syspath_prepend(str(root))
    capsys.readouterr()
    code = main(["check", f"{module}:trigger", "--no-store-probe"])
    return code, capsys.readouterr().out


@pytest.mark.binlog
def test_binlog_source_names_the_missing_table(
    binlog_db: BinlogDatabase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    source = f'BinlogSource({binlog_db.url!r}, ["nosuch"], snapshot="never")'
    code, out = check(tmp_path, source, monkeypatch, capsys)
    assert code == 1, out
    assert f"ERROR    tables                 table {binlog_db.name}.nosuch does not exist" in out
    assert "create it, or correct tables=" in out
    assert "privileges" not in out
    assert "GRANT" not in out


@pytest.mark.cdc
def test_pg_logical_source_names_the_missing_table(
    cdc_db: CdcDatabase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out = check(tmp_path, f'PgLogicalSource({cdc_db.url!r}, ["nosuch"])', monkeypatch, capsys)
    assert code == 1, out
    assert "ERROR    tables                 table public.nosuch does not exist" in out
    assert "create it, or correct tables=" in out
    assert "source_access" not in out
