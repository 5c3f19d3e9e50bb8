"""Log-based sources when a watched table's key column is renamed or dropped under a poller.

The source learns the table's primary key when it sets up and takes each
change's key from those columns. After ``RENAME COLUMN id TO key`` (or ``DROP
COLUMN id``) the log's description of the table no longer has them, and every
change was delivered with an empty key (``pk == {}``): a handler upserting by
key wrote every row onto one, without a word. Now the first such change stops
delivery (``SchemaChangedError`` naming the column; what came before is
delivered), and a restarted worker reads the key again.

A key column renamed is the key still, under its new name: the log says so (the
Relation message's identity flags; on MariaDB the table map's primary key with
``binlog_row_metadata=FULL``, else the catalog read when the new definition is
met), and the changes after the rename are keyed by it without a restart.
"""

from __future__ import annotations

import pytest

from dbtrigger import RowChange
from dbtrigger.cdc import BinlogSource
from dbtrigger.errors import SchemaChangedError
from tests.cdc_servers import BinlogDatabase, CdcDatabase
from tests.test_cdc_binlog import Collector, make_table
from tests.test_cdc_binlog import trigger as binlog_trigger
from tests.test_cdc_pg import drain, poller

pytestmark = pytest.mark.timeout(120)


def test_changes_without_their_key_are_refused(cdc_db: CdcDatabase) -> None:
    cdc_db.execute("CREATE TABLE t (id int PRIMARY KEY, note text)")
    trigger, source = poller(cdc_db, ["t"])
    drain(trigger)
    with cdc_db.connect() as conn:
        conn.execute("INSERT INTO t VALUES (1, 'a')")
        conn.execute("ALTER TABLE t DROP COLUMN id")
        conn.execute("INSERT INTO t VALUES ('b')")
    delivered: list[RowChange] = []
    with pytest.raises(SchemaChangedError, match=r"key column id of public\.t"):
        trigger.drain(delivered.extend)  # before: delivered with pk == {}
    assert [dict(e.pk) for e in delivered] == [{"id": 1}]  # what came before is delivered
    with pytest.raises(SchemaChangedError):  # and it stays refused
        trigger.tick(lambda events: None)
    trigger.close()
    source.close()


def test_a_renamed_key_column_keys_the_changes_after_it(cdc_db: CdcDatabase) -> None:
    cdc_db.execute("CREATE TABLE t (id int PRIMARY KEY, note text)")
    trigger, source = poller(cdc_db, ["t"])
    drain(trigger)
    with cdc_db.connect() as conn:
        conn.execute("INSERT INTO t VALUES (1, 'a')")
        conn.execute("ALTER TABLE t RENAME COLUMN id TO key")
        conn.execute("INSERT INTO t VALUES (2, 'b')")
    # before: SchemaChangedError until a restart, which then keyed them {"key": 2}
    assert [dict(e.pk) for e in drain(trigger)] == [{"id": 1}, {"key": 2}]
    trigger.close()
    source.close()


def test_binlog_changes_without_their_key_are_refused(binlog_db: BinlogDatabase) -> None:
    """The same on MariaDB: the log names the columns (binlog_row_metadata=FULL), and a
    key column gone from them left every change with an empty key."""
    table = make_table(binlog_db)
    source = BinlogSource(binlog_db.url, [table], reader="r1")
    poller = binlog_trigger(source)
    seen = Collector()
    try:
        binlog_db.execute(f"INSERT INTO {table} VALUES (1, 'a', 10)")
        poller.drain(seen)  # set up on the table as it was
        binlog_db.execute(f"ALTER TABLE {table} DROP COLUMN id")
        binlog_db.execute(f"INSERT INTO {table} VALUES ('b', 20)")
        with pytest.raises(SchemaChangedError, match=rf"key column id of {binlog_db.name}\.items"):
            poller.drain(seen)  # before: delivered with pk == {}
    finally:
        poller.close()
        source.close()
    assert [dict(e.pk) for e in seen.events] == [{"id": 1}]


def test_binlog_a_renamed_key_column_keys_the_changes_after_it(binlog_db: BinlogDatabase) -> None:
    table = make_table(binlog_db)
    source = BinlogSource(binlog_db.url, [table], reader="r1")
    poller = binlog_trigger(source)
    seen = Collector()
    try:
        binlog_db.execute(f"INSERT INTO {table} VALUES (1, 'a', 10)")
        poller.drain(seen)
        binlog_db.execute(f"ALTER TABLE {table} RENAME COLUMN id TO k")
        binlog_db.execute(f"INSERT INTO {table} VALUES (2, 'b', 20)")
        poller.drain(seen)  # before: SchemaChangedError (key column id ...) until a restart
    finally:
        poller.close()
        source.close()
    assert [dict(e.pk) for e in seen.events] == [{"id": 1}, {"k": 2}]


def test_changes_written_while_the_table_had_no_primary_key_are_delivered(
    cdc_db: CdcDatabase, binlog_db: BinlogDatabase
) -> None:
    """Dropped and added again (a key being rebuilt): the log marks no key for the rows
    written in between. They are keyed by the key the worker read, as before; refusing
    them stopped delivery for good (a restarted worker met them keyless too)."""
    cdc_db.execute("CREATE TABLE t (id int PRIMARY KEY, note text)")
    trigger, source = poller(cdc_db, ["t"])
    drain(trigger)
    for statement in (
        "ALTER TABLE t DROP CONSTRAINT t_pkey",
        "INSERT INTO t VALUES (2, 'b')",
        "ALTER TABLE t ADD PRIMARY KEY (id)",
        "INSERT INTO t VALUES (3, 'c')",
    ):
        cdc_db.execute(statement)
    assert [dict(e.pk) for e in drain(trigger)] == [{"id": 2}, {"id": 3}]
    trigger.close()
    source.close()

    table = make_table(binlog_db)
    binlog_source = BinlogSource(binlog_db.url, [table], reader="r1")
    binlog_poller = binlog_trigger(binlog_source)
    seen = Collector()
    try:
        binlog_poller.drain(seen)
        binlog_db.execute(f"ALTER TABLE {table} DROP PRIMARY KEY")
        binlog_db.execute(f"INSERT INTO {table} VALUES (2, 'b', 20)")
        binlog_db.execute(f"ALTER TABLE {table} ADD PRIMARY KEY (id)")
        binlog_db.execute(f"INSERT INTO {table} VALUES (3, 'c', 30)")
        binlog_poller.drain(seen)
    finally:
        binlog_poller.close()
        binlog_source.close()
    assert [dict(e.pk) for e in seen.events] == [{"id": 2}, {"id": 3}]
