"""A slot created for a poller and then dropped: ``dbtrigger check`` and ``cdc install``
point at ``cdc recreate``, never at a silent new slot.

``check`` called the missing slot a WARNING to fix with ``cdc install --yes``, and
``install`` created a new slot: with ``snapshot="never"`` the poller then went on from
its checkpoint over the new slot, and what was written while the slot was gone was
never delivered, without a word (the worker itself refuses with ``SlotLostError``).
For a ``BinlogSource`` whose position's file was purged, ``check`` said "changes are
lost" as a WARNING and exited 0.
"""

from __future__ import annotations

import importlib
import uuid
from pathlib import Path
from typing import Any

import pytest

from dbtrigger.cli import main
from tests.cdc_servers import CdcDatabase, drop_slot
from tests.test_cdc_binlog import purge_all_but_newest
from tests.test_history_replay import _cdc_module

pytestmark = pytest.mark.timeout(120)


def test_check_and_install_name_recreate_for_a_slot_dropped_under_the_poller(
    cdc_db: CdcDatabase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cdc_db.execute("CREATE TABLE orders (id int PRIMARY KEY)")
    name = f"pg_lost_{uuid.uuid4().hex[:8]}"
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    spec = _cdc_module(
        tmp_path, name, f"PgLogicalSource({cdc_db.url!r}, ['orders'], snapshot='never')", name
    )
    module = importlib.import_module(name)
    module.trigger.drain(module.handle)
    cdc_db.execute("INSERT INTO orders VALUES (1)")
    module.trigger.drain(module.handle)
    module.trigger.source.close()
    with cdc_db.connect() as conn:
        drop_slot(conn, module.trigger.source.slot)
    cdc_db.execute("INSERT INTO orders VALUES (2)")  # written while no slot kept it

    capsys.readouterr()
    assert main(["check", spec]) != 0
    out = capsys.readouterr().out
    assert "ERROR" in out
    assert f"dbtrigger cdc recreate {spec} --snapshot --yes" in out  # ready to paste

    assert main(["cdc", "install", spec, "--yes"]) != 0
    out, err = capsys.readouterr()
    assert "cdc recreate" in err, out + err
    assert not cdc_db.scalar(
        "SELECT count(*) FROM pg_replication_slots WHERE slot_name = %s",
        (module.trigger.source.slot,),
    )  # before the fix: a new slot, and row 2 never delivered


@pytest.mark.binlog
def test_check_calls_a_purged_binlog_position_an_error(
    binlog_db: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The same for BinlogSource: "changes are lost" was a WARNING, `check` exited 0.
    binlog_db.execute("CREATE TABLE orders (id INT PRIMARY KEY)")
    name = f"binlog_lost_{uuid.uuid4().hex[:8]}"
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    spec = _cdc_module(
        tmp_path, name, f"BinlogSource({binlog_db.url!r}, ['orders'], snapshot='never')", name
    )
    module = importlib.import_module(name)
    binlog_db.execute("INSERT INTO orders VALUES (1)")
    module.trigger.drain(module.handle)
    module.trigger.source.close()
    purge_all_but_newest(binlog_db)
    capsys.readouterr()
    assert main(["check", spec]) != 0
    out = capsys.readouterr().out
    assert "ERROR    retention" in out, out
    assert f"dbtrigger cdc recreate {spec} --snapshot --yes" in out  # ready to paste
