"""BinlogSource: a snapshot lifts the stop at a cut-over only when asked for after it.

A table renamed onto a watched name (gh-ost's and pt-osc's cut-over) stops
delivery until a snapshot of the whole table is asked for after the statement
(``tests/test_cdc_binlog_table_gone.py``). "After" was decided by clocks: the
request's ``requested_at`` (the client's clock) against the statement's time in
the binary log (the server's, in whole seconds). A request made before the
cut-over in the same second, or on a client whose clock runs ahead, counted: the
stop was lifted, and when that snapshot had already read the table that left,
the rows of the table now under the name were never delivered. A client clock
behind the server's made a request after the statement count for nothing: the
stop never lifted. Now the request records where the log ended when it was made,
and only a position past the statement counts.

The statement's time in the log is the server session's ``timestamp``, set here
to stand for a statement in the request's second or a server clock ahead: the
outcome must not depend on it. ``asked_after``, the decision, is tested on its own
first (pure: requests and a statement's commit token in).
"""

from __future__ import annotations

import datetime as dt

import pytest

from dbtrigger.cdc import BinlogSource
from dbtrigger.cdc import binlog_control as control
from dbtrigger.cdc.binlog_reader import commit_token
from dbtrigger.cdc.binlog_snapshot import asked_after
from dbtrigger.cdc.snapshots import Snapshot
from tests.cdc_servers import BinlogDatabase
from tests.test_cdc_binlog import make_table
from tests.test_cdc_binlog_table_gone import seen, stopped, watching

GEN = 1764162000123456
STATEMENT = commit_token(3, 5000, "0-1-9", GEN)  # its transaction begins at 3:5000


def request(position: str | None, table: str = "db.items", where: str | None = None) -> Snapshot:
    """A request of ``table`` at log ``position``, its clock far in the future."""
    return Snapshot(table, where, requested_at="2099-01-01T00:00:00+00:00", log_position=position)


@pytest.mark.parametrize(
    ("requests", "after"),
    [
        ([request(commit_token(3, 5001, None, GEN))], True),  # the log held the statement
        ([request(commit_token(4, 4, None, GEN))], True),  # a later file
        ([request(commit_token(3, 5000, None, GEN))], False),  # the statement written next
        ([request(commit_token(3, 4000, None, GEN))], False),
        ([request(commit_token(2, 9000, None, GEN))], False),
        ([request(commit_token(3, 9000, None, GEN + 1))], False),  # another generation
        ([request(commit_token(3, 9000, None))], False),
        ([request(None)], False),  # an earlier version's: its time says nothing
        ([request("not a position")], False),
        ([request(commit_token(3, 9000, None, GEN), where="id = 1")], False),  # some rows
        ([request(commit_token(3, 9000, None, GEN), table="db.other")], False),
        ([request(None), request(commit_token(3, 9000, None, GEN))], True),
    ],
)
def test_asked_after_compares_log_positions_never_clocks(
    requests: list[Snapshot], after: bool
) -> None:
    assert asked_after(requests, "db.items", STATEMENT) is after


def test_a_reader_without_a_generation_compares_file_and_offset() -> None:
    statement = commit_token(3, 5000, "0-1-9")
    assert asked_after([request(commit_token(3, 5001, None))], "db.items", statement)
    assert not asked_after([request(commit_token(3, 5000, None))], "db.items", statement)
    assert not asked_after([request(commit_token(3, 9000, None, GEN))], "db.items", statement)


def cut_over(db: BinlogDatabase, logged_at: int) -> None:
    """gh-ost's cut-over of ``items``, written to the log with the time ``logged_at``."""
    with db.connect() as conn, conn.cursor() as cur:
        cur.execute("SET timestamp = %s", (logged_at,))
        cur.execute("RENAME TABLE items TO items_old, items_new TO items")


def snapshot_rows(got: list[object]) -> dict[object, dict[str, object]]:
    return {
        e.pk["id"]: dict(e.after or {})  # type: ignore[attr-defined]
        for e in got
        if e.op == "upsert"  # type: ignore[attr-defined]
    }


@pytest.mark.binlog
@pytest.mark.timeout(180)
def test_a_snapshot_asked_for_before_the_cut_over_in_its_second_does_not_lift_the_stop(
    binlog_db: BinlogDatabase,
) -> None:
    make_table(binlog_db)
    t, _, _, got = watching(binlog_db, ["items"])
    source = t.source
    assert isinstance(source, BinlogSource)
    binlog_db.execute("INSERT INTO items VALUES (1, 'old', 1)")
    make_table(binlog_db, "items_new")
    binlog_db.execute("INSERT INTO items_new VALUES (1, 'new', 10), (2, 'new', 20)")
    asked = source.admin().request_snapshot("items")  # before the cut-over
    t.drain(got.extend)  # the snapshot reads the table that is about to leave
    assert snapshot_rows(got) == {1: {"id": 1, "note": "old", "n": 1}}
    requested = dt.datetime.fromisoformat(asked["requested_at"])
    cut_over(binlog_db, int(requested.timestamp()))  # logged in the request's second
    del got[:]

    said = stopped(t, got.extend)
    assert "never read as" in said
    assert "a request made before the statement was written does not count" in said
    assert got == []  # nothing of the table now under the name, no truncate

    source.admin().request_snapshot("items")  # after it: read the name on
    t.drain(got.extend)
    assert seen(got)[0] == ("truncate", None, f"{binlog_db.name}.items")
    assert snapshot_rows(got) == {
        1: {"id": 1, "note": "new", "n": 10},
        2: {"id": 2, "note": "new", "n": 20},
    }
    source.close()


@pytest.mark.binlog
@pytest.mark.timeout(180)
def test_a_snapshot_asked_for_after_the_cut_over_lifts_the_stop_whatever_the_log_time(
    binlog_db: BinlogDatabase,
) -> None:
    make_table(binlog_db)
    t, _, _, got = watching(binlog_db, ["items"])
    source = t.source
    assert isinstance(source, BinlogSource)
    make_table(binlog_db, "items_new")
    binlog_db.execute("INSERT INTO items_new VALUES (1, 'new', 10)")
    hour_ahead = dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1)
    cut_over(binlog_db, int(hour_ahead.timestamp()))  # a server clock an hour ahead
    stopped(t, got.extend)

    source.admin().request_snapshot("items")
    t.drain(got.extend)
    assert seen(got)[0] == ("truncate", None, f"{binlog_db.name}.items")
    assert snapshot_rows(got) == {1: {"id": 1, "note": "new", "n": 10}}
    source.close()


@pytest.mark.binlog
@pytest.mark.timeout(180)
def test_a_request_recorded_without_the_log_position_does_not_lift_the_stop(
    binlog_db: BinlogDatabase,
) -> None:
    """One written by an earlier version (``requested_at`` only) is not known to be
    after the statement, whatever its time says: the stop stays, saying to ask again."""
    make_table(binlog_db)
    t, _, _, got = watching(binlog_db, ["items"])
    source = t.source
    assert isinstance(source, BinlogSource)
    make_table(binlog_db, "items_new")
    binlog_db.execute("INSERT INTO items_new VALUES (1, 'new', 10)")
    cut_over(binlog_db, int(dt.datetime.now(dt.timezone.utc).timestamp()))
    said = stopped(t, got.extend)

    day_ahead = dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=1)
    old = Snapshot(f"{binlog_db.name}.items", requested_at=day_ahead.isoformat())
    with binlog_db.connect() as conn:
        control.update(conn, source.control_database, source.reader, snapshots=[old])
        conn.commit()
    assert stopped(t, got.extend) == said
    assert not [e for e in got if e.op in ("truncate", "upsert")]

    source.admin().request_snapshot("items")
    t.drain(got.extend)
    assert snapshot_rows(got) == {1: {"id": 1, "note": "new", "n": 10}}
    source.close()
