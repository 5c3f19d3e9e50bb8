"""BinlogSource without column names in the log (``binlog_row_metadata`` not FULL,
MariaDB's default): a column change that keeps the count, read while it happens.

Names came from the catalog read when the source started, checked by count only:
after ``DROP COLUMN b, ADD COLUMN c INT`` every change carried ``b`` for ``c`` until
a restart. The server gives the table a new map id when it loads the changed
definition, and each new id is now named by the catalog read then (right for a
reader that keeps up; one behind a later ``ALTER`` still gets its names).
"""

from __future__ import annotations

import uuid

import pytest

from dbtrigger import InMemoryCheckpointStore, PollTrigger, RowChange
from dbtrigger.cdc import BinlogSource, binlog_setup
from tests.cdc_servers import BinlogDatabase

pytestmark = pytest.mark.timeout(120)


def test_a_column_dropped_and_another_added_names_the_changes_after_it(
    binlog_db: BinlogDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The private server logs names (FULL); the source is made to read the catalog's.
    monkeypatch.setattr(binlog_setup.ServerFacts, "names_from_log", property(lambda _: False))
    binlog_db.execute("CREATE TABLE t (id INT PRIMARY KEY, a INT, b INT)")
    got: list[RowChange] = []
    trigger = PollTrigger(
        name=f"p_{uuid.uuid4().hex[:8]}",
        source=BinlogSource(binlog_db.url, ["t"], snapshot="never"),
        checkpoint_store=InMemoryCheckpointStore(),
    )
    trigger.drain(got.extend)
    binlog_db.execute("INSERT INTO t VALUES (1, 10, 20)")
    trigger.drain(got.extend)
    binlog_db.execute("ALTER TABLE t DROP COLUMN b, ADD COLUMN c INT")
    binlog_db.execute("INSERT INTO t VALUES (2, 11, 30)")
    trigger.drain(got.extend)  # read before the next ALTER runs: the catalog fits it
    binlog_db.execute("ALTER TABLE t CHANGE a renamed INT")
    binlog_db.execute("UPDATE t SET c = 31 WHERE id = 2")
    trigger.drain(got.extend)
    trigger.source.close()
    assert [dict(e.after or {}) for e in got] == [
        {"id": 1, "a": 10, "b": 20},
        {"id": 2, "a": 11, "c": 30},
        {"id": 2, "renamed": 11, "c": 31},
    ]
