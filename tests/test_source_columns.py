"""DDL on a polled table under a running poller, at default settings.

The source reflected its table once and selected the reflected columns: a
column added by ``ALTER TABLE ... ADD COLUMN`` was missing from every event's
``after`` until the worker restarted (a handler copying rows lost its values,
silently), and a dropped column failed every fetch (SourceDefinitionError,
"retrying cannot help") until then. Now the source compares the table's
columns with its own at most every ``CHECK_SECONDS`` and whenever a fetch
fails, and reads the table again when they differ (dbtrigger._columns).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import sqlalchemy as sa

from dbtrigger import InMemoryCheckpointStore, PollTrigger, RowChange, SqlAlchemySource
from dbtrigger.cursor import BEGINNING
from dbtrigger.errors import SerializationError, SourceDefinitionError
from dbtrigger.partitions.layout import Partition
from dbtrigger.partitions.source import PartitionSource
from tests.databases import TestDatabase
from tests.reliability_support import add_items, items_table

ITEM_COLUMNS = {"id", "version", "payload", "amount", "seen_at"}


def source_for(db: TestDatabase, mode: str = "table") -> SqlAlchemySource:
    """The items table at default settings (visibility ``auto``): as a table, or as
    a ``SELECT *`` query."""
    if mode == "query":
        query = f"SELECT * FROM {db.qualified('items')}"
        return SqlAlchemySource(url=db.url, query=query, cursor_column="version", pk_columns=["id"])
    return SqlAlchemySource(
        url=db.url, table="items", schema=db.schema, cursor_column="version", pk_columns=["id"]
    )


def alter(db: TestDatabase, *statements: str) -> None:
    for sql in statements:
        db.execute(sql.format(t=db.qualified("items")))


def note_column(db: TestDatabase) -> str:
    return "ALTER TABLE {t} ADD COLUMN note VARCHAR(20)"


def add_noted(db: TestDatabase, key: int, note: str) -> None:
    db.execute(
        f"INSERT INTO {db.qualified('items')} (id, version, payload, note) "
        "VALUES (:i, :v, 'p', :n)",
        {"i": key, "v": key * 10, "n": note},
    )


class Collect:
    def __init__(self) -> None:
        self.afters: list[dict[str, Any]] = []

    def __call__(self, events: list[RowChange]) -> None:
        self.afters.extend(dict(e.after or {}) for e in events)


@pytest.mark.parametrize("mode", ["table", "query"])
def test_a_column_added_under_a_running_poller_is_in_the_next_events(
    db: TestDatabase, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The delay is ``CHECK_SECONDS`` (30 s by default): here 0, so the next fetch looks."""
    monkeypatch.setattr("dbtrigger._columns.CHECK_SECONDS", 0.0)
    table = items_table(db)
    add_items(db, table, [1, 2])
    source = source_for(db, mode)
    fingerprint = source.fingerprint()
    trigger = PollTrigger(name="items", source=source, checkpoint_store=InMemoryCheckpointStore())
    seen = Collect()
    try:
        assert trigger.drain(seen) == 2
        alter(db, note_column(db))
        add_noted(db, 3, "hi")
        assert trigger.drain(seen) == 1
    finally:
        trigger.close()
        source.close()
    assert set(seen.afters[0]) == ITEM_COLUMNS
    assert seen.afters[2]["note"] == "hi"  # before: no "note" until a restart
    assert set(seen.afters[2]) == ITEM_COLUMNS | {"note"}
    # An added column is no other source: a restarted worker keeps its checkpoint.
    assert source_for(db, mode).fingerprint() == fingerprint


def test_a_column_dropped_under_a_running_poller_is_followed_with_a_warning(
    db: TestDatabase, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Long before the next scheduled look: the failed fetch makes the source look,
    and it reads the batch again on the columns the table has now. Nothing is
    skipped, nothing fails, and the warning says what happened."""
    monkeypatch.setattr("dbtrigger._columns.CHECK_SECONDS", 3600.0)
    table = items_table(db)
    add_items(db, table, [1, 2])
    source = source_for(db)
    trigger = PollTrigger(name="items", source=source, checkpoint_store=InMemoryCheckpointStore())
    seen = Collect()
    try:
        assert trigger.drain(seen) == 2
        alter(db, "ALTER TABLE {t} DROP COLUMN payload", note_column(db))
        db.execute(f"INSERT INTO {db.qualified('items')} (id, version, note) VALUES (3, 30, 'x')")
        with caplog.at_level(logging.INFO, logger="dbtrigger"):
            assert trigger.drain(seen) == 1  # before: SourceDefinitionError, every tick
    finally:
        trigger.close()
        source.close()
    assert [a["id"] for a in seen.afters] == [1, 2, 3]
    assert set(seen.afters[2]) == ITEM_COLUMNS - {"payload"} | {"note"}
    [record] = [r for r in caplog.records if getattr(r, "event", "") == "source_columns_changed"]
    assert record.levelno == logging.WARNING
    assert record.dropped == ["payload"]  # type: ignore[attr-defined]
    assert record.added == ["note"]  # type: ignore[attr-defined]
    assert "dropped: payload" in record.getMessage()
    assert "on the old columns failed" in record.getMessage()


@pytest.mark.parametrize("column", ["version", "id"])
def test_a_cursor_or_key_column_renamed_is_refused_typed(
    db: TestDatabase, column: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The definition no longer fits the table: refused as at start-up (naming the
    column), never polled on other columns, and the checkpoint stays where it was."""
    monkeypatch.setattr("dbtrigger._columns.CHECK_SECONDS", 3600.0)
    table = items_table(db)
    add_items(db, table, [1, 2])
    source = source_for(db)
    store = InMemoryCheckpointStore()
    trigger = PollTrigger(name="items", source=source, checkpoint_store=store)
    try:
        assert trigger.drain(Collect()) == 2
        if db.kind == "mariadb" and column == "id":
            alter(db, "ALTER TABLE {t} CHANGE id item_id INTEGER NOT NULL")
        else:
            alter(db, f"ALTER TABLE {{t}} RENAME COLUMN {column} TO renamed")
        with pytest.raises(SerializationError) as refused:
            trigger.tick(Collect())
    finally:
        trigger.close()
        source.close()
    assert refused.value.fields["missing_columns"] == [column]
    assert column in str(refused.value)


def test_the_partitions_of_one_table_follow_an_added_column(
    db: TestDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Partitions share their table's shape: one look serves them all, and each
    partition's statements (its bucket filter with them) are built on the new one."""
    monkeypatch.setattr("dbtrigger._columns.CHECK_SECONDS", 0.0)
    table = items_table(db)
    add_items(db, table, range(1, 21))
    base = source_for(db)
    parts = [PartitionSource(base, Partition(lo, lo + 128), poller="items") for lo in (0, 128)]
    try:
        before = [len(p.fetch(BEGINNING, 100)) for p in parts]
        assert sum(before) == 20
        assert all(before)
        alter(db, note_column(db))
        db.execute(f"UPDATE {db.qualified('items')} SET note = 'n'")
        for part in parts:
            rows = part.fetch(BEGINNING, 100)
            events = part.to_events(rows, poller="items", batch_id="b")
            assert {e.after["note"] for e in events if e.after} == {"n"}
        assert sorted(len(p.fetch(BEGINNING, 100)) for p in parts) == sorted(before)
    finally:
        base.close()


def test_the_columns_are_looked_at_once_per_check_interval(
    sqlite_db: TestDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cost: at default settings a fetch runs no extra statement (one probe
    when the table is first read, then one every ``CHECK_SECONDS``)."""
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, range(1, 11))
    source = source_for(sqlite_db)
    probes: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.startswith("SELECT * ") and statement.endswith("WHERE 0 = 1"):
            probes.append(statement)

    sa.event.listen(source.engine, "before_cursor_execute", count)
    try:
        for after in range(0, 10, 2):
            source.fetch(BEGINNING if after == 0 else _at(after), 2)
        assert len(probes) == 1  # when the table was read
        monkeypatch.setattr("dbtrigger._columns.CHECK_SECONDS", 0.0)
        source.fetch(BEGINNING, 2)  # every fetch is due now: one probe each
        source.fetch(BEGINNING, 2)
        assert len(probes) == 3
    finally:
        source.close()


def _at(key: int) -> Any:
    from dbtrigger.cursor import Position  # noqa: PLC0415 - one helper's import

    return Position(cursor=key * 10, pk={"id": key})


def test_a_cursor_retyped_under_a_running_poller_names_the_type_change(
    server_db: TestDatabase,
) -> None:
    """``bigint`` to text while the poller runs. PostgreSQL fails the fetch (text >
    bigint), so the source looked at the columns at once; MariaDB compares them as
    numbers and returned the rows, whose text values the old columns' check refused
    as a bad value in a row ('Fix the value in that row'), and ``dbtrigger run``
    stopped on that advice. Either way the refusal now names the type change and
    how to re-enter the checkpoint, and the checkpoint stays."""
    db = server_db
    table = items_table(db)
    add_items(db, table, [1, 2])
    source = source_for(db)
    trigger = PollTrigger(name="items", source=source, checkpoint_store=InMemoryCheckpointStore())
    try:
        assert trigger.drain(Collect()) == 2
        if db.kind == "postgresql":
            alter(db, "ALTER TABLE {t} ALTER COLUMN version TYPE varchar(40)")
        else:
            alter(db, "ALTER TABLE {t} MODIFY version VARCHAR(40) NOT NULL")
        db.execute(
            f"INSERT INTO {db.qualified('items')} (id, version, payload) VALUES (3, '30', 'p')"
        )
        with pytest.raises(SourceDefinitionError) as refused:
            trigger.tick(Collect())
    finally:
        trigger.close()
        source.close()
    message = str(refused.value)
    assert "its type changed under the checkpoint" in message
    assert "dbtrigger reset" in message
    assert "Fix the value in that row" not in message


def test_a_timestamp_cursor_made_timestamptz_is_followed_not_refused(pg: TestDatabase) -> None:
    """``timestamp`` to ``timestamptz`` while the poller runs: PostgreSQL compares the
    old bound with the new column, so the read went on, and its aware values were
    delivered and checkpointed in order. The next fetch then held that checkpoint
    against the columns the source had read before the change and refused it
    ('holds a timestamp (with time zone) value ... but the column is now TIMESTAMP
    WITHOUT TIME ZONE'): dbtrigger run stopped on a checkpoint that fits the table.
    Now a checkpoint that does not fit makes the source look at the columns first."""
    db = pg
    db.execute(f"CREATE TABLE {db.qualified('events')} (id INTEGER PRIMARY KEY, at TIMESTAMP)")
    insert = f"INSERT INTO {db.qualified('events')} VALUES (:i, :at)"
    db.execute(insert, [{"i": i, "at": f"2026-01-01 12:0{i}:00"} for i in (1, 2)])
    source = SqlAlchemySource(
        url=db.url, table="events", schema=db.schema, cursor_column="at", pk_columns=["id"]
    )
    trigger = PollTrigger(name="events", source=source, checkpoint_store=InMemoryCheckpointStore())
    seen = Collect()
    try:
        assert trigger.drain(seen) == 2
        db.execute(f"ALTER TABLE {db.qualified('events')} ALTER COLUMN at TYPE timestamptz")
        db.execute(insert, {"i": 3, "at": "2026-01-01 12:03:00+00"})
        assert trigger.drain(seen) == 1
        db.execute(insert, {"i": 4, "at": "2026-01-01 12:04:00+00"})
        assert trigger.drain(seen) == 1  # before: SourceDefinitionError
    finally:
        trigger.close()
        source.close()
    assert [a["id"] for a in seen.afters] == [1, 2, 3, 4]


def test_a_column_retyped_under_a_running_poller_on_postgresql(pg: TestDatabase) -> None:
    """psycopg prepares the fetch on the server once a connection has run it five
    times; after another session's ``ALTER COLUMN payload TYPE text`` PostgreSQL
    refuses it ("cached plan must not change result type"). Every later fetch failed
    that way, for good, until a restart; now the pool's connections are replaced and
    the fetch runs again (``dbtrigger._engine.renew_stale_plans``)."""
    table = items_table(pg)
    add_items(pg, table, range(1, 23))
    source = source_for(pg)
    trigger = PollTrigger(
        name="items", source=source, checkpoint_store=InMemoryCheckpointStore(), batch_size=2
    )
    seen = Collect()
    try:
        for _ in range(8):  # past psycopg's prepare_threshold (5) for the same fetch
            assert trigger.tick(seen) == 2
        alter(pg, "ALTER TABLE {t} ALTER COLUMN payload TYPE text")
        assert trigger.tick(seen) == 2  # before: FetchError, on this tick and every later one
        assert trigger.tick(seen) == 2
    finally:
        trigger.close()
        source.close()
    assert [a["id"] for a in seen.afters] == list(range(1, 21))
