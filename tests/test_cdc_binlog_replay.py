"""BinlogSource without column names in the log, across ``ALTER TABLE``: read on where the
names are certain, stop where they are not, and never name a key wrong.

MariaDB writes no column names into the binary log by default
(``binlog_row_metadata = NO_LOG``). A reader behind the log (a worker stopped, the
migration run, the worker started again) met a table map written before an ``ALTER
TABLE ... ADD COLUMN`` and had only the catalog as it is after it: it stopped
(``... was changed by a statement ...``) until a person set ``FULL`` and asked for a
snapshot, for the most common DDL there is. The statement's text and the catalog
now give the names before it (the added column taken out, a renamed one renamed
back), checked against the table map's column count and types. And the primary key
was the one read at the start: after ``DROP PRIMARY KEY, ADD PRIMARY KEY (id, a)``
each change came keyed ``{"id": ...}`` until a restart.

The server here runs with ``binlog_row_metadata`` NO_LOG or MINIMAL for these tests
(a real log without names, not a flag of the source), or FULL where the test says so.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dbtrigger import InMemoryCheckpointStore, PollTrigger, RowChange
from dbtrigger.cdc import BinlogSource
from dbtrigger.checks import check_trigger
from dbtrigger.errors import SourceDefinitionError
from tests import test_cdc_binlog_table_gone as gone
from tests.cdc_servers import BinlogDatabase

pytestmark = [pytest.mark.binlog, pytest.mark.timeout(120)]


@pytest.fixture
def no_names(binlog_db: BinlogDatabase, request: pytest.FixtureRequest) -> Iterator[None]:
    """The private server (this test's alone while it runs) logs no column names: none
    of the table map's metadata (NO_LOG, MariaDB's default; or ``request.param``:
    MINIMAL, types' only)."""
    metadata = getattr(request, "param", "NO_LOG")
    binlog_db.server.execute(f"SET GLOBAL binlog_row_metadata = '{metadata}'")
    try:
        yield
    finally:
        binlog_db.server.execute("SET GLOBAL binlog_row_metadata = 'FULL'")


def behind(
    db: BinlogDatabase, *statements: str, spec: str | None = None
) -> tuple[list[RowChange], BinlogSource]:
    """A worker stopped before ``statements`` ran and started again after them; what it
    delivered in a bounded drain (it raises if delivery stops). Row 1 is written
    before the statements, row 2 after them. ``spec``: where the trigger is defined,
    as ``dbtrigger run`` tells it."""
    db.execute("CREATE TABLE t (id INT PRIMARY KEY, a INT, b INT, s VARCHAR(20))")
    first, store, name, got = gone.watching(db, ["t"])
    first.source.close()  # type: ignore[attr-defined]
    db.execute("INSERT INTO t VALUES (1, 10, 20, 'x')")
    for statement in statements:
        db.execute(statement)
    db.execute("INSERT INTO t (id, a) VALUES (2, 11)")
    trigger = gone.poller(db, ["t"], store, name)
    trigger.cli_source = spec
    LAST[:] = [trigger]
    trigger.drain(got.extend)
    assert isinstance(trigger.source, BinlogSource)
    return got, trigger.source


#: The trigger :func:`behind` started last (it raises when delivery stops).
LAST: list[PollTrigger] = []

ROW_1 = {"id": 1, "a": 10, "b": 20, "s": "x"}


@pytest.mark.usefixtures("no_names")
@pytest.mark.parametrize("no_names", ["NO_LOG", "MINIMAL"], indirect=True)
@pytest.mark.parametrize(
    ("statements", "second"),
    [
        (["ALTER TABLE t ADD COLUMN c INT"], {"id": 2, "a": 11, "b": None, "s": None, "c": None}),
        (["ALTER TABLE t ADD c INT FIRST"], {"c": None, "id": 2, "a": 11, "b": None, "s": None}),
        (["ALTER TABLE t ADD c INT AFTER a"], {"id": 2, "a": 11, "c": None, "b": None, "s": None}),
        (["ALTER TABLE t ADD (c INT, d DATE), ADD INDEX ia (a)"], None),
        (["ALTER TABLE t RENAME COLUMN b TO b2"], {"id": 2, "a": 11, "b2": None, "s": None}),
        (
            ["ALTER TABLE t CHANGE b b2 INT NOT NULL DEFAULT 0"],
            {"id": 2, "a": 11, "b2": 0, "s": None},
        ),
        (
            ["ALTER TABLE t MODIFY b INT COMMENT 'after all'"],
            {"id": 2, "a": 11, "b": None, "s": None},
        ),
        (
            ["ALTER TABLE t ADD COLUMN c INT", "ALTER TABLE t RENAME COLUMN b TO b2"],
            {"id": 2, "a": 11, "b2": None, "s": None, "c": None},
        ),
    ],
)
def test_an_alter_whose_names_are_certain_is_read_on_by_a_reader_behind_it(
    binlog_db: BinlogDatabase, statements: list[str], second: dict[str, object] | None
) -> None:
    # Before: each stopped with "watched table ... was changed by a statement".
    got, source = behind(binlog_db, *statements)
    assert dict(got[0].after or {}) == ROW_1  # named as it was written
    if second is not None:
        assert dict(got[1].after or {}) == second
        assert list(dict(got[1].after or {})) == list(second)  # in the table's order
    assert [dict(e.pk) for e in got] == [{"id": 1}, {"id": 2}]
    source.close()


@pytest.mark.usefixtures("no_names")
@pytest.mark.parametrize(
    ("statement", "shown"),
    [
        ("ALTER TABLE t DROP COLUMN b", "DROP COLUMN b"),  # where b was: not in the text
        ("ALTER TABLE t MODIFY b INT FIRST", "MODIFY b INT FIRST"),  # where b was
        ("ALTER TABLE t MODIFY s VARBINARY(20)", "MODIFY s VARBINARY(20)"),  # how s reads
        ("ALTER TABLE t ADD COLUMN IF NOT EXISTS c INT", "IF NOT EXISTS"),  # did it?
        ("ALTER TABLE t DROP PRIMARY KEY, ADD PRIMARY KEY (id, a)", "PRIMARY KEY"),  # key?
        ("ALTER TABLE t ADD c INT AFTER a, DROP COLUMN b", "DROP COLUMN b"),
    ],
)
def test_an_alter_whose_names_or_key_are_not_certain_still_stops_before_them(
    binlog_db: BinlogDatabase, statement: str, shown: str
) -> None:
    with pytest.raises(Exception, match="was changed by a statement") as stop:
        behind(binlog_db, statement, spec="orders_app:trigger")
    said = str(stop.value)
    assert shown in said
    # the command ready to paste (before: MODULE:TRIGGER, to be filled in by hand)
    assert f"dbtrigger cdc snapshot orders_app:trigger --table {binlog_db.name}.t --yes" in said


def test_check_names_the_trigger_in_the_commands_of_a_held_delivery(
    binlog_db: BinlogDatabase,
) -> None:
    # `dbtrigger check app:trigger` (and a starting worker) said MODULE:TRIGGER there too.
    binlog_db.server.execute("SET GLOBAL binlog_row_metadata = 'NO_LOG'")
    try:
        with pytest.raises(SourceDefinitionError):
            behind(binlog_db, "ALTER TABLE t DROP COLUMN b", spec="orders_app:trigger")
    finally:
        binlog_db.server.execute("SET GLOBAL binlog_row_metadata = 'FULL'")
    trigger = LAST[0]
    [held] = [
        f for f in check_trigger(trigger, probe_store=False).findings if f.check == "delivery"
    ]
    assert f"dbtrigger cdc snapshot orders_app:trigger --table {binlog_db.name}.t" in held.message
    trigger.source.close()  # type: ignore[attr-defined]


@pytest.mark.usefixtures("no_names")
def test_a_reader_running_before_two_alters_names_the_changes_between_them(
    binlog_db: BinlogDatabase,
) -> None:
    # Its reading at the start, the first ALTER done on it, names the middle change; the
    # catalog now (after the second, which dropped c) cannot. Before: a stop.
    binlog_db.execute("CREATE TABLE t (id INT PRIMARY KEY, a INT, b INT)")
    trigger, _store, _name, got = gone.watching(binlog_db, ["t"])
    binlog_db.execute("INSERT INTO t VALUES (1, 10, 20)")
    binlog_db.execute("ALTER TABLE t DROP COLUMN b, ADD COLUMN c INT")
    binlog_db.execute("INSERT INTO t VALUES (2, 11, 30)")
    binlog_db.execute("ALTER TABLE t DROP COLUMN c, ADD COLUMN d INT")
    binlog_db.execute("INSERT INTO t VALUES (3, 12, 40)")
    trigger.drain(got.extend)
    assert [dict(e.after or {}) for e in got] == [
        {"id": 1, "a": 10, "b": 20},
        {"id": 2, "a": 11, "c": 30},
        {"id": 3, "a": 12, "d": 40},
    ]
    trigger.source.close()  # type: ignore[attr-defined]


@pytest.mark.usefixtures("no_names")
def test_a_snapshot_is_read_from_a_log_without_column_names(binlog_db: BinlogDatabase) -> None:
    # Before: the chunk rows' values came named UNKNOWN_COL0..2, each chunk was taken for
    # another reader's, and the initial snapshot delivered nothing (silently).
    binlog_db.execute("CREATE TABLE t (id INT PRIMARY KEY, a INT)")
    binlog_db.execute("INSERT INTO t VALUES (1, 10), (2, 20)")
    source = BinlogSource(binlog_db.url, ["t"])  # snapshot="initial"
    trigger = PollTrigger(name="p_snap", source=source, checkpoint_store=InMemoryCheckpointStore())
    got: list[RowChange] = []
    trigger.drain(got.extend)
    assert [(e.op, dict(e.after or {})) for e in got] == [
        ("upsert", {"id": 1, "a": 10}),
        ("upsert", {"id": 2, "a": 20}),
    ]
    source.close()


@pytest.mark.parametrize("metadata", ["NO_LOG", "FULL"])
def test_a_primary_key_changed_under_a_running_reader_keys_the_changes_after_it_anew(
    binlog_db: BinlogDatabase, metadata: str
) -> None:
    # Before: keyed by the key read at the start ({"id": 2}) until a restart.
    binlog_db.server.execute(f"SET GLOBAL binlog_row_metadata = '{metadata}'")
    try:
        binlog_db.execute("CREATE TABLE t (id INT PRIMARY KEY, a INT NOT NULL, b INT)")
        trigger, _store, _name, got = gone.watching(binlog_db, ["t"])
        binlog_db.execute("INSERT INTO t VALUES (1, 10, 20)")
        trigger.drain(got.extend)
        binlog_db.execute("ALTER TABLE t DROP PRIMARY KEY, ADD PRIMARY KEY (a, id)")
        binlog_db.execute("INSERT INTO t VALUES (2, 11, 21)")
        binlog_db.execute("UPDATE t SET b = 22 WHERE id = 2")
        trigger.drain(got.extend)
        assert [dict(e.pk) for e in got] == [{"id": 1}, {"a": 11, "id": 2}, {"a": 11, "id": 2}]
        assert list(got[1].pk) == ["a", "id"]  # in key order
        source = trigger.source
        assert isinstance(source, BinlogSource)
        source.admin().request_snapshot("t")  # a snapshot's rows too (the start's key before)
        del got[:]
        trigger.drain(got.extend)
        assert sorted((e.op, tuple(e.pk.items())) for e in got) == [
            ("upsert", (("a", 10), ("id", 1))),
            ("upsert", (("a", 11), ("id", 2))),
        ]
        source.close()
    finally:
        binlog_db.server.execute("SET GLOBAL binlog_row_metadata = 'FULL'")


def test_a_reader_behind_a_primary_key_change_keys_by_the_log_when_it_names_columns(
    binlog_db: BinlogDatabase,
) -> None:
    # FULL: the table map carries the key. Before: {"id": 2} for the row after the ALTER.
    got, source = behind(binlog_db, "ALTER TABLE t DROP PRIMARY KEY, ADD PRIMARY KEY (id, a)")
    assert [dict(e.pk) for e in got] == [{"id": 1}, {"id": 2, "a": 11}]
    source.close()
