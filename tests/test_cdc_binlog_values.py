"""BinlogSource: a row's values are the same in its snapshot event, in every change read
from the binary log, and in a query of the table.

The replication package decoded ``SET`` as a Python set (an empty one as None), ``BIT``
as a text of digits, MariaDB's ``UUID``/``INET6`` as their stored bytes, ``BINARY(n)``
without its trailing zero bytes, ``FLOAT`` as the float32's exact double and the year
0000 as 1900, while the snapshot (a query) gave ``'a,c'``, bytes, text, ``0.1`` and 0:
a ``UUID`` key named one row twice.
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

import pymysql
import pytest

from dbtrigger import InMemoryCheckpointStore, PollTrigger, RowChange
from dbtrigger.cdc import BinlogSource, binlog_setup
from dbtrigger.cdc.binlog_values import inet6_text
from tests.cdc_servers import BinlogDatabase

pytestmark = pytest.mark.timeout(120)

ADDRESSES = [
    "::ffff:1.2.3.4",
    "::1.2.3.4",
    "::1",
    "::",
    "2001:db8::1",
    "2001:db8::",
    "1:0:0:1::1",
    "fe80::1:0:0:1",
    "1:2:3:4:5:6:7:8",
]


def test_snapshot_and_log_events_carry_the_values_a_query_gives(
    binlog_db: BinlogDatabase,
) -> None:
    binlog_db.execute(
        "CREATE TABLE t (id UUID PRIMARY KEY, n INT, flags SET('a','b','c'), "
        "b1 BIT(1), b10 BIT(10), b64 BIT(64), addr INET6, bin BINARY(4), vb VARBINARY(8), "
        "f FLOAT, y YEAR)"
    )
    values = [
        (str(uuid.uuid4()), "c,a", "b'1'", "b'1000000001'", "b'1'", ADDRESSES[0]),
        (str(uuid.uuid1()), "", "b'0'", "b'0'", "b'1111111111111111'", ADDRESSES[1]),
        (str(uuid.uuid4()), "b", "NULL", "b'11'", "NULL", ADDRESSES[2]),
        ("a0eebc99-9c0b-4ef8-bb6d-6bb9bd380000", None, "b'1'", "b'0'", "b'0'", None),
    ] + [(str(uuid.uuid4()), "a,b,c", "b'1'", "b'10'", "b'101'", a) for a in ADDRESSES[3:]]
    floats = [(0.1, 2026), (123456.7, 0), (None, None), (12345.678, 1901), (3.4e38, 2155)]
    binary = [(b"\x01\0\0\0", b""), (b"\0\0\0\0", b"\0\0"), (None, None), (b"ab\0\0", b"x\0")]
    conn = binlog_db.connect(cursorclass=pymysql.cursors.DictCursor)
    with conn.cursor() as cur:
        for i, (key, flags, b1, b10, b64, addr) in enumerate(values):
            cur.execute(
                f"INSERT INTO t VALUES (%s, 1, %s, {b1}, {b10}, {b64}, %s, %s, %s, %s, %s)",
                (key, flags, addr, *binary[i % len(binary)], *floats[i % len(floats)]),
            )
    conn.commit()
    got: list[RowChange] = []
    trigger = PollTrigger(
        name=f"p_{uuid.uuid4().hex[:8]}",
        source=BinlogSource(binlog_db.url, ["t"]),
        checkpoint_store=InMemoryCheckpointStore(),
        batch_size=50,
    )
    trigger.drain(got.extend)  # the snapshot
    binlog_db.execute("UPDATE t SET n = 2")
    trigger.drain(got.extend)
    with conn.cursor() as cur:
        cur.execute("SELECT * FROM t")
        table: dict[str, dict[str, Any]] = {r["id"]: dict(r) for r in cur.fetchall()}
    binlog_db.execute("DELETE FROM t")
    trigger.drain(got.extend)
    conn.close()

    rows = len(values)
    assert [e.op for e in got] == ["upsert"] * rows + ["update"] * rows + ["delete"] * rows
    for event in got:
        key = event.pk["id"]
        assert isinstance(key, str)
        assert key in table, event.pk  # one key for the row in every event
        images = [event.after] if event.op == "upsert" else []
        images += [event.before] if event.op == "delete" else []
        images += [event.before, event.after] if event.op == "update" else []
        for image in images:
            assert image is not None
            assert {**image, "n": 0} == {**table[key], "n": 0}, event.op
    assert all(event.op != "update" or event.after["n"] == 2 for event in got)  # type: ignore[index]


@pytest.mark.parametrize("text", ADDRESSES)
def test_inet6_text_is_the_server_s(binlog_db: BinlogDatabase, text: str) -> None:
    conn = binlog_db.connect()
    with conn.cursor() as cur:
        cur.execute(
            "SELECT CAST(CAST(%s AS INET6) AS BINARY(16)), CAST(CAST(%s AS INET6) AS CHAR)",
            (text, text),
        )
        stored, printed = cur.fetchone()
    conn.close()
    assert inet6_text(bytes(stored)) == printed == text


def test_a_column_added_while_the_poller_runs_gets_the_query_s_values(
    binlog_db: BinlogDatabase,
) -> None:
    # A UUID is a 16-byte string in the log, told apart by the catalog only: a column
    # added after the source read the catalog came as bytes until a restart.
    binlog_db.execute("CREATE TABLE t (id INT PRIMARY KEY)")
    got: list[RowChange] = []
    trigger = PollTrigger(
        name=f"p_{uuid.uuid4().hex[:8]}",
        source=BinlogSource(binlog_db.url, ["t"], snapshot="never"),
        checkpoint_store=InMemoryCheckpointStore(),
    )
    trigger.drain(got.extend)
    binlog_db.execute("INSERT INTO t VALUES (1)")
    trigger.drain(got.extend)  # the catalog read, the table map seen
    key = "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a00"
    binlog_db.execute("ALTER TABLE t ADD COLUMN u UUID, ADD COLUMN vb VARBINARY(4)")
    binlog_db.execute("INSERT INTO t VALUES (2, %s, '')", (key,))
    trigger.drain(got.extend)
    trigger.source.close()
    assert [dict(e.after or {}) for e in got] == [{"id": 1}, {"id": 2, "u": key, "vb": b""}]


def test_a_snapshot_by_a_bit_key_reads_each_row_once(binlog_db: BinlogDatabase) -> None:
    # The chunk's last key (bytes) was compared with the BIT column as a string:
    # rows of earlier chunks came again (233 upserts for 200 rows in chunks of 7).
    binlog_db.execute("CREATE TABLE t (id BIT(16) PRIMARY KEY, v INT)")
    binlog_db.execute("INSERT INTO t SELECT seq, 0 FROM seq_1_to_200")
    got: list[RowChange] = []
    trigger = PollTrigger(
        name=f"p_{uuid.uuid4().hex[:8]}",
        source=BinlogSource(binlog_db.url, ["t"], snapshot_chunk_size=7),
        checkpoint_store=InMemoryCheckpointStore(),
        batch_size=100,
    )
    trigger.drain(got.extend)
    trigger.source.close()
    keys = [int.from_bytes(e.pk["id"], "big") for e in got]
    assert keys == list(range(1, 201))


def _snapshot_update_delete(binlog_db: BinlogDatabase, rows: int) -> list[RowChange]:
    """Every image of table ``t`` (a ``n`` column is set to 2): snapshot, update, delete."""
    got: list[RowChange] = []
    trigger = PollTrigger(
        name=f"p_{uuid.uuid4().hex[:8]}",
        source=BinlogSource(binlog_db.url, ["t"]),
        checkpoint_store=InMemoryCheckpointStore(),
        batch_size=50,
    )
    trigger.drain(got.extend)
    binlog_db.execute("UPDATE t SET n = 2")
    trigger.drain(got.extend)
    binlog_db.execute("DELETE FROM t")
    trigger.drain(got.extend)
    trigger.source.close()
    assert [e.op for e in got] == ["upsert"] * rows + ["update"] * rows + ["delete"] * rows
    return got


TIMES = ["-838:59:59.999999", "-00:00:01.25", "-10:00:59.9", "-00:00:00.000001", "-12:34:56"]


def test_negative_times_with_fractions_and_zero_dates_are_the_query_s(
    binlog_db: BinlogDatabase,
) -> None:
    # The package negated a negative TIME's whole seconds and fraction apart (-1.25 s
    # came as -1.75 s), made a zero DATE or DATETIME None (a NULL) and a zero TIMESTAMP
    # 1970-01-01: the row's changes disagreed with its snapshot and with a query.
    binlog_db.execute(
        "CREATE TABLE t (id INT PRIMARY KEY, n INT, t2 TIME(2), t6 TIME(6), d DATE, "
        "dt DATETIME, dt3 DATETIME(3), ts TIMESTAMP NULL, ts6 TIMESTAMP(6) NULL)"
    )
    conn = binlog_db.connect(cursorclass=pymysql.cursors.DictCursor)
    with conn.cursor() as cur:
        cur.execute("SET sql_mode = ''")  # zero dates into TIMESTAMP too
        for i, time in enumerate(TIMES):
            zero = "0000-00-00 00:00:00"
            cur.execute(
                "INSERT INTO t VALUES (%s, 1, %s, %s, %s, %s, %s, %s, %s)",
                (i, time, time, zero[:10], zero, zero, zero, zero),
            )
        cur.execute(
            "INSERT INTO t VALUES (9, 1, '01:00:00.5', '-00:00:00', '2026-01-02', "
            "'2026-01-02 03:04:05', NULL, '2026-01-02 03:04:05', NULL)"
        )
        cur.execute("SET time_zone = '+00:00'")
        cur.execute("SELECT * FROM t")
        table = {r["id"]: {**r, "n": 0} for r in cur.fetchall()}
    conn.commit()
    conn.close()
    assert table[1]["t2"] == -dt.timedelta(seconds=1.25)  # the query's value, for the reader
    for event in _snapshot_update_delete(binlog_db, len(table)):
        for image in (event.before, event.after):
            if image is not None:
                assert {**image, "n": 0} == table[event.pk["id"]], event.op


def test_a_timestamp_is_utc_in_the_snapshot_and_the_log_whatever_the_server_s_zone(
    binlog_db: BinlogDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The log holds a TIMESTAMP in UTC; a snapshot chunk read it in the server's time
    # zone (time_zone = SYSTEM on a host outside UTC): the row moved by the offset.
    authenticate = binlog_setup.Connection._request_authentication

    def server_in_india(self: Any) -> None:  # as if the server's time_zone were +05:30
        authenticate(self)
        self.query("SET time_zone = '+05:30'")

    monkeypatch.setattr(binlog_setup.Connection, "_request_authentication", server_in_india)
    binlog_db.execute("CREATE TABLE t (id INT PRIMARY KEY, n INT, ts TIMESTAMP(3) NULL)")
    conn = binlog_db.connect()
    with conn.cursor() as cur:
        cur.execute("SET time_zone = '+00:00'")
        cur.execute("INSERT INTO t VALUES (1, 1, '2026-01-02 03:04:05.678')")
    conn.commit()
    conn.close()
    utc = dt.datetime(2026, 1, 2, 3, 4, 5, 678000)  # the query's naive value
    got = _snapshot_update_delete(binlog_db, 1)
    assert [(e.after or e.before or {})["ts"] for e in got] == [utc, utc, utc]
