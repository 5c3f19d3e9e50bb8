"""Log-based sources when a watched table's key column is renamed or dropped under a poller.

The source learns the table's primary key when it sets up and takes each
change's key from those columns. After ``RENAME COLUMN id TO key`` (or ``DROP
COLUMN id``) the log's description of the table no longer has them, and every
change was delivered with an empty key (``pk == {}``): a handler upserting by
key wrote every row onto one, without a word. Now the first such change stops
delivery (``SchemaChangedError`` naming the column; what came before is
delivered), and a restarted worker reads the key again.
"""

from __future__ import annotations

import pytest

from dbtrigger import RowChange
from dbtrigger.cdc import BinlogSource, PgLogicalSource
from dbtrigger.cursor import Position
from dbtrigger.errors import SchemaChangedError
from tests.cdc_servers import BinlogDatabase, CdcDatabase
from tests.test_cdc_binlog import Collector, make_table
from tests.test_cdc_binlog import trigger as binlog_trigger
from tests.test_cdc_pg import drain, poller

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("ddl", ["ALTER TABLE t RENAME COLUMN id TO key", "drop"])
def test_changes_without_their_key_are_refused(cdc_db: CdcDatabase, ddl: str) -> None:
    cdc_db.execute("CREATE TABLE t (id int PRIMARY KEY, note text)")
    trigger, source = poller(cdc_db, ["t"])
    drain(trigger)
    with cdc_db.connect() as conn:
        conn.execute("INSERT INTO t VALUES (1, 'a')")
        if ddl == "drop":
            conn.execute("ALTER TABLE t DROP COLUMN id")
            conn.execute("INSERT INTO t VALUES ('b')")
        else:
            conn.execute(ddl)
            conn.execute("INSERT INTO t VALUES (2, 'b')")
    delivered: list[RowChange] = []
    with pytest.raises(SchemaChangedError, match=r"key column id of public\.t"):
        trigger.drain(delivered.extend)  # before: delivered with pk == {}
    assert [dict(e.pk) for e in delivered] == [{"id": 1}]  # what came before is delivered
    with pytest.raises(SchemaChangedError):  # and it stays refused
        trigger.tick(lambda events: None)
    if ddl != "drop":  # a worker started now keys the changes by the renamed column
        restarted = PgLogicalSource(cdc_db.url, ["t"], slot=source.slot, snapshot="never")
        rows = restarted.fetch(Position(delivered[-1].cursor, dict(delivered[-1].pk)), 10)
        assert [r["pk"] for r in rows] == [{"key": 2}]
        restarted.close()
    trigger.close()
    source.close()


@pytest.mark.parametrize("ddl", ["ALTER TABLE items RENAME COLUMN id TO k", "drop"])
def test_binlog_changes_without_their_key_are_refused(binlog_db: BinlogDatabase, ddl: str) -> None:
    """The same on MariaDB: the log names the columns (binlog_row_metadata=FULL), and a
    key column gone from them left every change with an empty key."""
    table = make_table(binlog_db)
    source = BinlogSource(binlog_db.url, [table], reader="r1")
    poller = binlog_trigger(source)
    seen = Collector()
    try:
        binlog_db.execute(f"INSERT INTO {table} VALUES (1, 'a', 10)")
        poller.drain(seen)  # set up on the table as it was
        if ddl == "drop":
            binlog_db.execute(f"ALTER TABLE {table} DROP COLUMN id")
            binlog_db.execute(f"INSERT INTO {table} VALUES ('b', 20)")
        else:
            binlog_db.execute(ddl)
            binlog_db.execute(f"INSERT INTO {table} VALUES (2, 'b', 20)")
        with pytest.raises(SchemaChangedError, match=rf"key column id of {binlog_db.name}\.items"):
            poller.drain(seen)  # before: delivered with pk == {}
    finally:
        poller.close()
        source.close()
    assert [dict(e.pk) for e in seen.events] == [{"id": 1}]
