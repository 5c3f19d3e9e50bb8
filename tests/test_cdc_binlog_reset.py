"""BinlogSource after its server's binary log was reset (``RESET MASTER``) or replaced by
another server's log under the same file names: a position recorded in the control row
(where the reader was created, or read through) names a file and offset, and a file of
that name can exist again holding other transactions. The reader must refuse it, never
read on from that offset in a log it does not belong to.

Each test resets the log of the session's private server (never the shared one); the
tests before and after each use a reader and database of their own."""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

import pytest

from dbtrigger import InMemoryCheckpointStore, PollTrigger, RowChange
from dbtrigger.cdc import BinlogSource
from dbtrigger.cdc import binlog_control as control
from dbtrigger.cdc.binlog_reader import Where
from dbtrigger.errors import ConfigurationError, SlotLostError
from tests.cdc_servers import BinlogDatabase, BinlogMariadb

pytestmark = pytest.mark.timeout(120)


class Collector:
    def __init__(self) -> None:
        self.events: list[RowChange] = []

    def __call__(self, events: list[RowChange]) -> None:
        self.events.extend(events)

    def ids(self) -> list[int]:
        return [int(e.pk["id"]) for e in self.events]


def trigger(source: BinlogSource, store: Any, name: str) -> PollTrigger:
    return PollTrigger(name=name, source=source, checkpoint_store=store, batch_size=50)


def reset_log(server: BinlogMariadb, previous: int | None = None) -> int:
    """``RESET MASTER``, in a later second of the server's clock than ``previous`` (the
    value an earlier call returned): a binlog file's identity includes the second it was
    created in. Returns the server's clock (seconds) after the reset."""
    if previous is not None:
        deadline = time.monotonic() + 10
        while int(server.scalar("SELECT UNIX_TIMESTAMP()")) <= previous:
            assert time.monotonic() < deadline, "the server's clock did not move on"
            time.sleep(0.05)
    server.execute("RESET MASTER")
    assert server.scalar("SHOW MASTER STATUS") == "binlog.000001"
    return int(server.scalar("SELECT UNIX_TIMESTAMP()"))


def make_table(db: BinlogDatabase, name: str = "items") -> str:
    db.execute(f"CREATE TABLE {name} (id INT PRIMARY KEY, note VARCHAR(100), n INT)")
    return name


def control_row(db: BinlogDatabase, reader: str) -> control.ControlRow:
    conn = db.connect()
    try:
        row = control.read(conn, db.name, reader)
    finally:
        conn.close()
    assert row is not None
    return row


def boundaries(server: BinlogMariadb, name: str) -> list[int]:
    """The offsets in binary log ``name`` where a transaction ends."""
    conn = server.connect()
    try:
        with conn.cursor() as cur:
            cur.execute(f"SHOW BINLOG EVENTS IN '{name}'")
            return [int(r[4]) for r in cur.fetchall() if r[2] in ("Xid", "Query")]
    finally:
        conn.close()


def test_a_reset_between_install_and_the_first_read_is_refused_not_read_from_the_offset(
    binlog_db: BinlogDatabase,
) -> None:
    """The reader was created in binlog.000001; after RESET MASTER a new binlog.000001
    holds, at the recorded offset, the end of a transaction written after the reset. The
    change written between install and the reset is gone, and the one before the offset
    in the new file would be skipped: refused, naming cdc recreate --snapshot."""
    server = binlog_db.server
    table = make_table(binlog_db)
    store = InMemoryCheckpointStore()
    name = f"lr_new_{uuid.uuid4().hex[:6]}"
    BinlogSource(binlog_db.url, [table], snapshot="never", reader="other").admin().install()
    first = reset_log(server)
    binlog_db.execute(f"INSERT INTO {table} VALUES (1, 'a', 1)")
    source = BinlogSource(binlog_db.url, [table], snapshot="never")
    t = trigger(source, store, name)
    source.admin().install()
    created = control_row(binlog_db, name)
    assert created.created_file == "binlog.000001"
    binlog_db.execute(f"INSERT INTO {table} VALUES (2, 'b', 2)")  # lost with the old log
    reset_log(server, first)
    binlog_db.execute(f"INSERT INTO {table} VALUES (3, 'c', 3)")  # same size as row 1
    binlog_db.execute(f"INSERT INTO {table} VALUES (4, 'd', 4)")
    assert created.created_pos in boundaries(server, "binlog.000001")
    seen = Collector()
    with pytest.raises(SlotLostError, match="RESET MASTER") as caught:
        t.tick(seen)
    assert "dbtrigger cdc recreate" in str(caught.value)
    assert "--snapshot" in str(caught.value)
    assert seen.ids() == []
    status = source.admin().status()
    assert not status["healthy"]
    assert any("RESET MASTER" in w for w in status["warnings"])
    source.admin().recreate(snapshot=True)
    t.drain(seen)
    assert sorted(seen.ids()) == [1, 2, 3, 4]  # the snapshot brings the rows back
    source.close()


def test_a_read_through_position_in_a_file_of_the_same_name_after_a_reset_is_refused(
    binlog_db: BinlogDatabase,
) -> None:
    """Read-through was recorded at an offset of binlog.000001; after RESET MASTER the new
    binlog.000001 has a transaction boundary at that very offset. Starting there would
    skip the quiet table's changes written after the reset before it."""
    server = binlog_db.server
    quiet = make_table(binlog_db, "quiet")
    busy = make_table(binlog_db, "busy")
    store = InMemoryCheckpointStore()
    name = f"lr_through_{uuid.uuid4().hex[:6]}"
    first = reset_log(server)
    source = BinlogSource(binlog_db.url, [quiet], snapshot="never", heartbeat_interval_seconds=0)
    t = trigger(source, store, name)
    seen = Collector()
    t.tick(seen)
    binlog_db.execute(f"INSERT INTO {quiet} VALUES (1, 'a', 1)")
    t.drain(seen)
    for i in range(5):
        binlog_db.execute(f"INSERT INTO {busy} VALUES ({i}, 'x', 0)")
    t.tick(seen)
    t.tick(seen)  # idle: read-through is written behind the durable checkpoint
    row = control_row(binlog_db, name)
    assert row.through_file == "binlog.000001"
    assert seen.ids() == [1]
    source.close()
    reset_log(server, first)
    for i in range(2, 12):
        binlog_db.execute(f"INSERT INTO {quiet} VALUES ({i}, 'b', {i})")
    # A boundary of the new file inside the quiet table's new changes, as the recorded
    # offset of the old file could be: it is the name and offset that are checked today.
    offset = boundaries(server, "binlog.000001")[3]
    conn = binlog_db.connect()
    control.update(conn, binlog_db.name, name, through_pos=offset)
    conn.close()
    again = BinlogSource(binlog_db.url, [quiet], snapshot="never")
    t2 = trigger(again, store, name)
    more = Collector()
    with pytest.raises(SlotLostError, match="RESET MASTER") as caught:
        t2.tick(more)
    assert "dbtrigger cdc recreate" in str(caught.value)
    assert more.ids() == []
    again.close()


def test_a_checkpoint_beyond_the_end_of_a_reset_log_needs_only_cdc_recreate(
    binlog_db: BinlogDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    """The checkpoint is in binlog.000003 of the old log; after RESET MASTER the server has
    binlog.000001 only. That is not a purge, and cdc recreate is the one step: it starts a
    new reader generation, so the checkpoint (of the old one) is passed over instead of
    leaving the poller "after" every position of the new log, which is numbered from its
    start again (before, the error named a second step, dbtrigger reset --to-beginning)."""
    server = binlog_db.server
    table = make_table(binlog_db)
    store = InMemoryCheckpointStore()
    name = f"lr_back_{uuid.uuid4().hex[:6]}"
    first = reset_log(server)
    server.execute("FLUSH BINARY LOGS")
    server.execute("FLUSH BINARY LOGS")
    source = BinlogSource(binlog_db.url, [table], snapshot="never")
    t = trigger(source, store, name)
    seen = Collector()
    t.tick(seen)
    binlog_db.execute(f"INSERT INTO {table} VALUES (1, 'a', 1)")
    t.drain(seen)
    assert seen.ids() == [1]
    checkpoint = t.read_state().position.cursor  # type: ignore[union-attr]
    assert Where.parse(checkpoint.split("#")[0]).file_index == 3
    source.close()
    reset_log(server, first)
    binlog_db.execute(f"INSERT INTO {table} VALUES (2, 'b', 2)")
    caplog.set_level(logging.WARNING, "dbtrigger.cdc")
    with pytest.raises(SlotLostError, match="RESET MASTER") as caught:
        t.tick(seen)
    message = str(caught.value)
    assert "beyond the end" in message
    assert "dbtrigger cdc recreate MODULE:TRIGGER --snapshot --yes" in message
    assert "--to-beginning" not in message
    retention = [
        r.getMessage() for r in caplog.records if getattr(r, "event", "") == "cdc_binlog_retention"
    ]
    assert retention
    assert all("RESET MASTER" in m for m in retention), retention
    source.admin().recreate(snapshot=True)
    binlog_db.execute(f"INSERT INTO {table} VALUES (3, 'c', 3)")
    more = Collector()
    t.drain(more)  # the same poller, its checkpoint of the old log kept
    assert sorted(set(more.ids())) == [1, 2, 3]
    source.close()


def test_a_reset_while_the_poller_runs_is_refused_at_its_next_read(
    binlog_db: BinlogDatabase,
) -> None:
    """A running reader goes on where its last read ended (file and offset, kept in
    memory): after RESET MASTER the new binlog.000001 is checked like a recorded position,
    before its events are read from that offset."""
    server = binlog_db.server
    table = make_table(binlog_db)
    store = InMemoryCheckpointStore()
    name = f"lr_running_{uuid.uuid4().hex[:6]}"
    first = reset_log(server)
    source = BinlogSource(binlog_db.url, [table], snapshot="never")
    t = trigger(source, store, name)
    seen = Collector()
    t.tick(seen)
    binlog_db.execute(f"INSERT INTO {table} VALUES (1, 'a', 1)")
    t.drain(seen)
    assert seen.ids() == [1]
    end = _end_of_log(server)
    reset_log(server, first)
    i = 2
    while _end_of_log(server) <= end:  # the new file reaches past where the reader is
        binlog_db.execute(f"INSERT INTO {table} VALUES ({i}, 'b', {i})")
        i += 1
    with pytest.raises(SlotLostError, match="RESET MASTER") as caught:
        t.tick(seen)
    assert "is not the one" in str(caught.value)
    assert seen.ids() == [1]
    source.close()


def _end_of_log(server: BinlogMariadb) -> int:
    conn = server.connect()
    try:
        with conn.cursor() as cur:
            cur.execute("SHOW MASTER STATUS")
            row = cur.fetchone()
    finally:
        conn.close()
    assert row is not None
    return int(row[1])


def test_a_control_table_of_an_earlier_version_gains_its_columns_and_keeps_its_readers(
    binlog_db: BinlogDatabase,
) -> None:
    """The file marks are columns added to the control table: a table an earlier version
    made lacks them. Status refuses with what to run, the dry run lists the ALTER, and
    the next start adds them in place, resuming where the reader stood."""
    table = make_table(binlog_db)
    name = f"r{uuid.uuid4().hex[:8]}"
    store = InMemoryCheckpointStore()
    source = BinlogSource(binlog_db.url, [table], snapshot="never", reader=name)
    source.admin().install()
    binlog_db.execute(f"INSERT INTO {table} VALUES (1, 'a', 1)")
    got = Collector()
    trigger(source, store, name).drain(got)
    assert got.ids() == [1]
    source.close()
    binlog_db.execute(
        f"ALTER TABLE {control.TABLE} DROP COLUMN created_mark, DROP COLUMN through_mark"
    )
    binlog_db.execute(f"INSERT INTO {table} VALUES (2, 'b', 2)")
    again = BinlogSource(binlog_db.url, [table], snapshot="never", reader=name)
    with pytest.raises(ConfigurationError, match=r"earlier version.*cdc install"):
        control_row(binlog_db, name)
    plan = again.admin().plan()
    assert any("ADD COLUMN created_mark" in s for s in plan.statements), plan.statements
    trigger(again, store, name).drain(got)
    assert got.ids() == [1, 2]
    assert control_row(binlog_db, name).created_file is not None
    again.close()
