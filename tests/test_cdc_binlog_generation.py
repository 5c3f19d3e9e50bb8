"""BinlogSource after RESET MASTER and ``cdc recreate``: the poller's checkpoint is a
position in the old log, and the new log numbers its files, offsets and (MariaDB) GTID
sequence numbers from the start again. A checkpoint token of the old log can name a
transaction of the new one exactly (same file, offset and GTID); read as a position of
the new log, everything before it there is skipped without a word. Positions carry the
reader's generation (set by install and recreate), so an old checkpoint is recognised
as one of a log the operator has since started again from.

Each test resets the log of the session's private server (never the shared one)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from dbtrigger import InMemoryCheckpointStore, PollTrigger, RowChange
from dbtrigger.cdc import BinlogSource
from dbtrigger.cdc import binlog_control as control
from dbtrigger.cdc.binlog_reader import Where, commit_token
from dbtrigger.cdc.position import LogPosition
from dbtrigger.errors import CorruptStateError, SlotLostError
from tests.cdc_servers import BinlogDatabase, BinlogMariadb
from tests.test_cdc_binlog_reset import reset_log

pytestmark = pytest.mark.timeout(120)


def test_tokens_carry_the_generation_and_sort_after_those_of_earlier_ones() -> None:
    old = commit_token(3, 12345, "0-1-4711")
    first = commit_token(1, 99999, "0-1-4711", 1_764_162_000_123_456)
    later = commit_token(1, 4, "0-1-1", 1_764_162_000_123_457)
    assert first == "1764162000123456.0000000001:000000099999:0-1-4711"
    assert Where.parse(old) == Where(3, 12345, "0-1-4711", None)
    assert Where.parse(first) == Where(1, 99999, "0-1-4711", 1_764_162_000_123_456)
    assert Where.parse(commit_token(1, 4, "uuid:7", 5)).gtid == "uuid:7"  # MySQL: a colon
    assert LogPosition(old, 9) < LogPosition(first, 1) < LogPosition(later, 1)
    with pytest.raises(CorruptStateError):
        Where.parse("17.0000000001:000000000004")
    assert control.next_generation(None, 2.5) == 2_500_000
    row = control.ControlRow("r", None, 1, [], None, None, generation=9_000_000)
    assert control.next_generation(row, 2.5) == 9_000_001  # never back, whatever the clock


def end_of_log(server: BinlogMariadb) -> tuple[int, int]:
    """(offset where the next transaction starts, the GTID sequence number it will have)."""
    conn = server.connect()
    try:
        with conn.cursor() as cur:
            cur.execute("SHOW MASTER STATUS")
            row = cur.fetchone()
            cur.execute("SELECT @@gtid_binlog_pos")
            pos = cur.fetchone()
    finally:
        conn.close()
    assert row is not None
    assert pos is not None
    seq = int(str(pos[0]).rsplit("-", 1)[1]) if pos[0] else 0
    return int(row[1]), seq + 1


def test_an_old_checkpoint_matching_a_transaction_of_the_new_log_is_not_read_from(
    binlog_db: BinlogDatabase,
) -> None:
    server = binlog_db.server
    binlog_db.execute("CREATE TABLE pad (id INT PRIMARY KEY, note MEDIUMTEXT)")
    store = InMemoryCheckpointStore()
    name = f"gen_{uuid.uuid4().hex[:6]}"
    first = reset_log(server)
    source = BinlogSource(binlog_db.url, ["pad"], snapshot="never")
    trigger = PollTrigger(name=name, source=source, checkpoint_store=store, batch_size=50)
    got: list[RowChange] = []
    trigger.tick(got.extend)
    for i in range(100, 110):
        binlog_db.execute("INSERT INTO pad VALUES (%s, %s)", (i, "x" * 1000))
    trigger.drain(got.extend)
    assert [e.pk["id"] for e in got] == list(range(100, 110))
    cursor: Any = trigger.read_state().position.cursor  # type: ignore[union-attr]
    where = Where.parse(cursor.split("#")[0])
    assert where.file_index == 1
    assert where.gtid is not None
    checkpoint_seq = int(where.gtid.rsplit("-", 1)[1])
    source.close()

    reset_log(server, first)
    source.admin().recreate(snapshot=False)  # "only what happens from now on"
    # The new log, written on after the recreate: fillers, then a transaction starting at
    # the checkpoint's offset with the checkpoint's GTID (what an unlucky workload writes).
    start, seq = end_of_log(server)
    assert start < where.offset
    fillers = checkpoint_seq - seq  # transactions before the one at the checkpoint's offset
    assert fillers >= 3, (start, seq, where)
    ids = iter(range(200, 300))
    written: list[int] = []

    def insert(key: int, note: str) -> None:
        binlog_db.execute("INSERT INTO pad VALUES (%s, %s)", (key, note))
        written.append(key)

    sizes = []
    for note in (1, 2):  # what one more character of the note costs in the log
        before, _ = end_of_log(server)
        insert(next(ids), "y" * note)
        sizes.append(end_of_log(server)[0] - before)
    per_char = sizes[1] - sizes[0]
    base = sizes[0] - per_char
    for _ in range(fillers - 3):
        insert(next(ids), "y")
    here, _ = end_of_log(server)
    gap = where.offset - here - base
    key = next(ids) + (1000 if gap % per_char else 0)  # one more digit: one byte more
    gap -= gap % per_char
    assert gap >= per_char, (here, base, per_char)
    insert(key, "y" * (gap // per_char))
    assert end_of_log(server) == (where.offset, checkpoint_seq)
    insert(next(ids), "z")  # at the checkpoint's offset, with its GTID
    insert(next(ids), "z")
    after: list[RowChange] = []
    trigger.drain(after.extend)
    assert [e.pk["id"] for e in after] == written  # every change since the recreate
    source.close()


def test_a_checkpoint_of_a_later_generation_than_the_control_row_is_refused(
    binlog_db: BinlogDatabase,
) -> None:
    # The control row is older than the checkpoint (restored from a backup, say): where
    # its changes continue cannot be told, and reading from its start would repeat or skip.
    binlog_db.execute("CREATE TABLE pad (id INT PRIMARY KEY, note MEDIUMTEXT)")
    name = f"gen_{uuid.uuid4().hex[:6]}"
    source = BinlogSource(binlog_db.url, ["pad"], snapshot="never")
    trigger = PollTrigger(
        name=name, source=source, checkpoint_store=InMemoryCheckpointStore(), batch_size=50
    )
    trigger.tick(lambda events: None)
    binlog_db.execute("INSERT INTO pad VALUES (1, 'a')")
    got: list[RowChange] = []
    trigger.drain(got.extend)
    assert [e.pk["id"] for e in got] == [1]
    source.close()
    binlog_db.execute(f"UPDATE {control.TABLE} SET generation = generation - 1")
    with pytest.raises(SlotLostError, match=r"generation.*cdc recreate"):
        trigger.tick(got.extend)
    source.close()


def reset_in(server: BinlogMariadb, second: int) -> None:
    """RESET MASTER with the new first file created in ``second`` (its mark's second)."""
    conn = server.connect()
    try:
        with conn.cursor() as cur:
            cur.execute("SET timestamp = %s", (second,))
            cur.execute("RESET MASTER")
    finally:
        conn.close()


def test_two_resets_within_one_second_are_told_apart_at_a_recorded_position(
    binlog_db: BinlogDatabase,
) -> None:
    """Both new first files have the mark (server id, creation second) of the other: the
    GTID the log held at the recorded offset (BINLOG_GTID_POS) tells them apart."""
    server = binlog_db.server
    binlog_db.execute("CREATE TABLE quiet (id INT PRIMARY KEY, note VARCHAR(20))")
    binlog_db.execute("CREATE TABLE busy (id INT PRIMARY KEY, note VARCHAR(20))")
    second = int(server.scalar("SELECT UNIX_TIMESTAMP()")) - 3600
    reset_in(server, second)
    store = InMemoryCheckpointStore()
    name = f"gen_{uuid.uuid4().hex[:6]}"
    source = BinlogSource(binlog_db.url, ["quiet"], snapshot="never", heartbeat_interval_seconds=0)
    trigger = PollTrigger(name=name, source=source, checkpoint_store=store, batch_size=50)
    got: list[RowChange] = []
    trigger.tick(got.extend)
    binlog_db.execute("INSERT INTO quiet VALUES (1, 'a')")
    trigger.drain(got.extend)
    for i in range(5):
        binlog_db.execute("INSERT INTO busy VALUES (%s, 'x')", (i,))
    trigger.tick(got.extend)
    trigger.tick(got.extend)  # idle: read-through recorded behind the durable checkpoint
    conn = binlog_db.connect()
    try:
        row = control.read(conn, binlog_db.name, name)
    finally:
        conn.close()
    assert row is not None
    assert row.through_file == "binlog.000001"
    assert [e.pk["id"] for e in got] == [1]
    source.close()
    reset_in(server, second)  # the same second: the same mark
    for i in range(2, 12):
        binlog_db.execute("INSERT INTO quiet VALUES (%s, 'b')", (i,))
    conn = server.connect()
    try:
        with conn.cursor() as cur:
            cur.execute("SHOW BINLOG EVENTS IN 'binlog.000001'")
            ends = [int(r[4]) for r in cur.fetchall() if r[2] in ("Xid", "Query")]
    finally:
        conn.close()
    # The recorded offset as a boundary of the new file (where an equal workload puts it).
    conn = binlog_db.connect()
    try:
        control.update(conn, binlog_db.name, name, through_pos=ends[3])
    finally:
        conn.close()
    again = BinlogSource(binlog_db.url, ["quiet"], snapshot="never", reader=name)
    status = again.admin().status()
    assert not status["healthy"]
    assert any("holds GTID" in w for w in status["warnings"]), status["warnings"]
    more: list[RowChange] = []
    with pytest.raises(SlotLostError, match="RESET MASTER"):
        PollTrigger(name=name, source=again, checkpoint_store=store, batch_size=50).tick(
            more.extend
        )
    assert more == []
    again.close()
