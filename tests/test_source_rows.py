"""The fetch path reads driver tuples: same values as SQLAlchemy, same ids, typed errors.

``SqlAlchemySource.fetch`` takes rows straight from the DB-API cursor and
applies SQLAlchemy's result processors itself, only where a column type has
one. These tests hold it to the values SQLAlchemy's own result gives for the
same table on SQLite, PostgreSQL and MariaDB, pin the event ids of a known
row state, and check that a value the dialect cannot convert is a
``SerializationError`` naming the column and the key, out of ``fetch`` and out
of a tick.
"""

from __future__ import annotations

import datetime as dt
import decimal
import enum
import hashlib
import time
import uuid
from typing import Any

import pytest
import sqlalchemy as sa

from dbtrigger import (
    DbTriggerError,
    InMemoryCheckpointStore,
    PollTrigger,
    SerializationError,
    SqlAlchemySource,
)
from dbtrigger.cursor import BEGINNING, Position
from dbtrigger.sources.rows import ResultProcessors, Rows, read_rows
from tests.databases import TestDatabase
from tests.test_source_sqlalchemy import insert, make_table, naive, precise_datetime


class Colour(enum.Enum):
    red = "red"
    blue = "blue"


def typed_table(db: TestDatabase) -> sa.Table:
    return make_table(
        db,
        "typed_rows",
        sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("updated_at", precise_datetime(timezone=False), nullable=False),
        sa.Column("flag", sa.Boolean),
        sa.Column("amount", sa.Numeric(12, 3)),
        sa.Column("ratio", sa.Float),
        sa.Column("day", sa.Date),
        sa.Column("at", precise_datetime(timezone=False)),
        sa.Column("ref", sa.Uuid),
        sa.Column("doc", sa.JSON),
        sa.Column("blob", sa.LargeBinary),
        sa.Column("note", sa.String(40)),
        index=("updated_at", "id"),
    )


def typed_rows(n: int) -> list[dict[str, Any]]:
    return [
        {
            "id": i,
            "updated_at": naive(i),
            "flag": i % 2 == 0,
            "amount": decimal.Decimal("12.345") * i,
            "ratio": i / 7,
            "day": dt.date(2020, 1, 1) + dt.timedelta(days=i),
            "at": naive(i * 3600 + 0.25),
            "ref": uuid.UUID(int=i + 1),
            "doc": {"i": i, "tags": ["a", "b"]},
            "blob": bytes([i, 255 - i]),
            "note": None if i == 3 else f"n{i}",
        }
        for i in range(6)
    ]


def test_fetched_values_are_what_sqlalchemy_returns(db: TestDatabase) -> None:
    table = typed_table(db)
    insert(db, table, typed_rows(6))
    source = SqlAlchemySource(
        url=db.url,
        table="typed_rows",
        schema=db.schema,
        cursor_column="updated_at",
        pk_columns=["id"],
        visibility="none",
    )
    try:
        # SQLAlchemy's own reading of the same reflected table, Row by Row.
        reflected = sa.Table("typed_rows", sa.MetaData(), schema=db.schema, autoload_with=db.engine)
        with db.engine.connect() as conn:
            expected = [
                dict(r)
                for r in conn.execute(sa.select(reflected).order_by(reflected.c.id)).mappings()
            ]
        rows = source.fetch(BEGINNING, 10)
        events = source.to_events(rows, poller="p", batch_id="b")
    finally:
        source.close()
    assert isinstance(rows, Rows)
    assert len(events) == 6
    for event, want in zip(events, expected, strict=True):
        got = dict(event.after or {})
        if db.kind == "sqlite":
            # Key columns of a date/time type are read as their stored text on
            # SQLite (they are compared as text), everything else as SQLAlchemy does.
            assert got.pop("updated_at") == want.pop("updated_at").strftime("%Y-%m-%d %H:%M:%S.%f")
        assert got == want
        assert {k: type(v) for k, v in got.items()} == {k: type(v) for k, v in want.items()}


def test_rows_read_as_a_sequence_of_mappings() -> None:
    rows = Rows(("id", "c"), [(1, "a"), (2, "b")])
    assert rows == [{"id": 1, "c": "a"}, {"id": 2, "c": "b"}]
    assert [{"id": 1, "c": "a"}, {"id": 2, "c": "b"}] == rows  # noqa: SIM300 - the reflected ==
    assert rows[-1] == {"id": 2, "c": "b"}
    assert rows[:1] == [{"id": 1, "c": "a"}]
    assert [r["c"] for r in rows] == ["a", "b"]
    assert Rows(("id",), []) == []
    assert rows != [{"id": 1, "c": "a"}]


def test_the_same_row_state_keeps_its_id_on_every_database(db: TestDatabase) -> None:
    # Ids are persisted in failure records (redelivery skips rows by id): the
    # fetch path must give the id the state document's encoding always gave.
    table = make_table(
        db,
        "pinned",
        sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("updated_at", precise_datetime(timezone=False), nullable=False),
        index=("updated_at", "id"),
    )
    insert(db, table, [{"id": 12093, "updated_at": dt.datetime(2026, 4, 7, 1, 23, 45, 123456)}])
    source = SqlAlchemySource(
        url=db.url,
        table="pinned",
        schema=db.schema,
        cursor_column="updated_at",
        pk_columns=["id"],
        visibility="none",  # about values and ids, not about a guard holding rows back
    )
    try:
        (event,) = source.to_events(source.fetch(BEGINNING, 5), poller="orders", batch_id="b")
        # The same rows given to to_events as plain dicts (another source's way).
        (again,) = source.to_events(
            [dict(r) for r in source.fetch(BEGINNING, 5)], poller="orders", batch_id="b"
        )
    finally:
        source.close()
    if db.kind == "sqlite":  # the cursor is the stored text there
        cursor = '["str","2026-04-07 01:23:45.123456"]'
    else:
        cursor = '["naive_timestamp","2026-04-07T01:23:45.123456"]'
    material = '["orders",{"id":["int",12093]},' + cursor + "]"
    assert event.event_id == hashlib.sha256(material.encode()).hexdigest()[:32]
    assert again.event_id == event.event_id
    assert again == event


def test_positions_of_other_value_types_reuse_nothing_stale(db: TestDatabase) -> None:
    # The keyset statement is kept per shape of position; a position whose
    # values have other Python types (a `reset --to-cursor` timestamp on
    # SQLite, where rows carry the stored text) gets its own.
    table = make_table(
        db,
        "shapes",
        sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("updated_at", precise_datetime(timezone=False), nullable=False),
        index=("updated_at", "id"),
    )
    insert(db, table, [{"id": i, "updated_at": naive(i)} for i in range(6)])
    source = SqlAlchemySource(
        url=db.url,
        table="shapes",
        schema=db.schema,
        cursor_column="updated_at",
        pk_columns=["id"],
        visibility="none",  # about statements, not about a guard holding rows back
    )
    try:
        first = source.to_events(source.fetch(BEGINNING, 2), poller="p", batch_id="b")
        last = first[-1]
        from_row = source.fetch(Position(last.cursor, dict(last.pk)), 2)
        typed = source.fetch(Position(naive(1), {"id": 1}), 2)
        later = source.fetch(Position(naive(3), {"id": 3}), 2)
    finally:
        source.close()
    assert [r["id"] for r in from_row] == [2, 3]
    assert [r["id"] for r in typed] == [2, 3]
    assert [r["id"] for r in later] == [4, 5]


def test_an_unconvertible_value_is_a_serialization_error_naming_column_and_key(
    tmp_path: Any,
) -> None:
    # SQLite stores whatever text it is given in a DATETIME column; SQLAlchemy's
    # processor cannot parse 'yesterday'. That used to escape as a bare ValueError.
    url = f"sqlite:///{tmp_path / 'bad.db'}"
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "CREATE TABLE t (id INTEGER PRIMARY KEY, updated_at INTEGER NOT NULL, "
            "happened DATETIME, amount NUMERIC)"
        )
        conn.exec_driver_sql(
            "INSERT INTO t VALUES (1, 1, '2026-01-01 00:00:00', 1), (2, 2, 'yesterday', 2)"
        )
    engine.dispose()
    source = SqlAlchemySource(
        url=url, table="t", cursor_column="updated_at", pk_columns=["id"], visibility="none"
    )
    try:
        with pytest.raises(SerializationError, match=r"key \{'id': 2\}") as info:
            source.fetch(BEGINNING, 10)
        assert info.value.fields["column"] == "happened"
        assert "'yesterday'" in str(info.value)
        trigger = PollTrigger(
            name="bad", source=source, checkpoint_store=InMemoryCheckpointStore(), batch_size=10
        )
        handled: list[Any] = []
        with pytest.raises(DbTriggerError) as ticked:
            trigger.tick(handled.extend)
        assert isinstance(ticked.value, SerializationError)
        assert handled == []
        assert trigger.read_state() is None  # nothing committed, nothing skipped
    finally:
        source.close()


def test_an_unconvertible_value_is_named_on_every_database(db: TestDatabase) -> None:
    # The same class of failure through a processor every dialect has: an Enum
    # column (stored as text) holding a value the Python enum does not know.
    table = make_table(
        db,
        "colours",
        sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("updated_at", sa.Integer, nullable=False),
        sa.Column("colour", sa.String(10)),
    )
    insert(db, table, [{"id": 1, "updated_at": 1, "colour": "red"}])
    insert(db, table, [{"id": 2, "updated_at": 2, "colour": "green"}])
    typed = sa.table(
        "colours",
        sa.column("id", sa.BigInteger),
        sa.column("colour", sa.Enum(Colour, native_enum=False, validate_strings=False)),
        schema=db.schema,
    )
    stmt = sa.select(typed.c.id, typed.c.colour).order_by(typed.c.id)
    with db.engine.connect() as conn:
        with pytest.raises(SerializationError, match=r"key \{'id': 2\}.*'green'") as info:
            read_rows(conn, stmt, None, ResultProcessors(), source="colours", key_columns=["id"])
        assert info.value.fields["column"] == "colour"
        rows = read_rows(
            conn, stmt.where(typed.c.id == 1), None, ResultProcessors(), source="c", key_columns=[]
        )
    assert rows == [{"id": 1, "colour": Colour.red}]


def test_repeated_fetches_read_the_same_values_and_listeners_see_every_statement(
    db: TestDatabase,
) -> None:
    # After its first execution the keyset statement may run on the driver's
    # cursor directly (psycopg); the values must not differ, and an engine
    # whose statement events are listened to keeps seeing every statement.
    table = typed_table(db)
    insert(db, table, typed_rows(6))
    source = SqlAlchemySource(
        url=db.url,
        table="typed_rows",
        schema=db.schema,
        cursor_column="updated_at",
        pk_columns=["id"],
        visibility="none",
    )
    try:
        first = source.fetch(BEGINNING, 3)
        events = source.to_events(first, poller="p", batch_id="b")
        after = Position(events[-1].cursor, dict(events[-1].pk))
        rest = [source.fetch(after, 3) for _ in range(3)]
        again = [source.fetch(BEGINNING, 3) for _ in range(3)]
        assert all(r == rest[0] for r in rest)
        assert all(r == first for r in again)
        assert [r["id"] for r in rest[0]] == [3, 4, 5]
        kinds = {k: type(v) for k, v in first[0].items()}
        for got in (*rest, *again):
            for row in got:
                assert {k: type(v) for k, v in row.items() if v is not None} == {
                    k: kinds[k] for k, v in row.items() if v is not None
                }
        if db.kind == "postgresql":  # the direct path was taken
            assert source._processors._direct
        seen: list[str] = []
        sa.event.listen(source.engine, "before_cursor_execute", lambda *args: seen.append(args[2]))
        for _ in range(3):
            source.fetch(after, 3)
        assert len(seen) == 3
    finally:
        source.close()


@pytest.mark.postgresql
def test_a_dropped_connection_is_not_used_again_by_the_direct_path(pg: TestDatabase) -> None:
    # The direct path keeps its driver cursor with the pooled connection. When
    # the server drops that connection, the fetch fails, the connection is
    # invalidated, and the next fetch runs on a new one with a new cursor.
    typed_table(pg)
    insert(pg, typed_table(pg), typed_rows(9))
    source = SqlAlchemySource(
        url=pg.url,
        table="typed_rows",
        schema=pg.schema,
        cursor_column="updated_at",
        pk_columns=["id"],
        visibility="none",
    )
    try:
        first = source.fetch(BEGINNING, 3)
        after = Position(first[-1]["updated_at"], {"id": first[-1]["id"]})
        expected = [source.fetch(after, 3) for _ in range(3)][-1]
        assert [r["id"] for r in expected] == [3, 4, 5]
        assert source._processors._direct
        with pg.engine.connect() as admin:
            pids = (
                admin.execute(
                    sa.text(
                        "SELECT pid FROM pg_stat_activity "
                        "WHERE pid <> pg_backend_pid() AND query LIKE :pattern"
                    ),
                    {"pattern": f"%{pg.schema}.typed_rows%"},
                )
                .scalars()
                .all()
            )
            assert pids
            for pid in pids:
                admin.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
            gone = sa.text("SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(:pids)")
            deadline = time.monotonic() + 30
            while admin.execute(gone, {"pids": pids}).scalar() and time.monotonic() < deadline:
                admin.rollback()  # a fresh view of pg_stat_activity
                time.sleep(0.05)
        with pytest.raises(DbTriggerError):
            source.fetch(after, 3)
        assert source.fetch(after, 3) == expected
    finally:
        source.close()


def _plain_rows(ids: range) -> list[dict[str, Any]]:
    """Rows of ``typed_table`` with these ids, the cursor one second apart."""
    return [{"id": i, "updated_at": naive(i), "note": f"n{i}"} for i in ids]


def _checkouts(source: SqlAlchemySource) -> list[int]:
    """A list that grows by one at every checkout from ``source``'s pool."""
    counted: list[int] = []
    sa.event.listen(source.engine, "checkout", lambda *args: counted.append(1))
    return counted


@pytest.mark.postgresql
def test_a_catch_up_reads_on_one_connection_and_gives_it_back_at_its_end(
    pg: TestDatabase,
) -> None:
    # Fetches in autocommit keep their connection while batches come back full
    # (the next fetch follows at once), so a catch-up checks one out once. Every
    # read is still its own transaction: a row committed between two fetches is
    # read by the second. A short batch gives the connection back, and any other
    # statement of the source runs as before, on a connection of its own, even
    # when the pool holds a single one.
    table = typed_table(pg)
    insert(pg, table, _plain_rows(range(9)))
    source = SqlAlchemySource(
        url=pg.url,
        table="typed_rows",
        schema=pg.schema,
        cursor_column="updated_at",
        pk_columns=["id"],
        visibility="none",
        engine_kwargs={"pool_size": 1, "max_overflow": 0, "pool_timeout": 5},
    )
    try:
        first = source.fetch(BEGINNING, 3)  # decides the guard: autocommit from here on
        checkouts = _checkouts(source)
        after = Position(first[-1]["updated_at"], {"id": first[-1]["id"]})
        seen = [r["id"] for r in first]
        for late in (9, 10):
            rows = source.fetch(after, 3)
            seen += [r["id"] for r in rows]
            after = Position(rows[-1]["updated_at"], {"id": rows[-1]["id"]})
            insert(pg, table, _plain_rows(range(late, late + 1)))  # after this fetch
        assert len(checkouts) == 1
        assert source.engine.pool.checkedout() == 1  # kept for the next fetch
        assert source.count_after(BEGINNING) == 11  # not kept from this statement
        assert len(checkouts) == 2
        rest = source.fetch(after, 3)
        seen += [r["id"] for r in rest]
        assert seen == list(range(11)), "the rows committed between fetches are read"
        assert len(rest) < 3
        assert source.engine.pool.checkedout() == 0  # the catch-up ended: given back
    finally:
        source.close()


@pytest.mark.postgresql
def test_a_kept_connection_the_server_dropped_while_idle_is_replaced(
    pg: TestDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A kept connection idle for as long as a pooled one would be pinged is
    # pinged before the fetch uses it: one the server dropped meanwhile is
    # replaced, and the fetch reads on a new one instead of failing.
    import dbtrigger.sources.connections as module  # noqa: PLC0415 - its idle bound

    insert(pg, typed_table(pg), _plain_rows(range(9)))
    source = SqlAlchemySource(
        url=pg.url,
        table="typed_rows",
        schema=pg.schema,
        cursor_column="updated_at",
        pk_columns=["id"],
        visibility="none",
    )
    try:
        source.fetch(BEGINNING, 3)
        first = source.fetch(BEGINNING, 3)
        assert source.engine.pool.checkedout() == 1
        monkeypatch.setattr(module, "PING_AFTER_IDLE_SECONDS", 0.0)
        after = Position(first[-1]["updated_at"], {"id": first[-1]["id"]})
        with source.engine.connect() as own:
            pid = own.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
        with pg.engine.connect() as admin:
            kept = (
                admin.execute(
                    sa.text(
                        "SELECT pid FROM pg_stat_activity WHERE pid <> pg_backend_pid() "
                        "AND pid <> :own AND query LIKE :pattern"
                    ),
                    {"own": pid, "pattern": f"%{pg.schema}.typed_rows%"},
                )
                .scalars()
                .all()
            )
            assert len(kept) == 1
            admin.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": kept[0]})
            gone = sa.text("SELECT count(*) FROM pg_stat_activity WHERE pid = :pid")
            deadline = time.monotonic() + 30
            while admin.execute(gone, {"pid": kept[0]}).scalar() and time.monotonic() < deadline:
                admin.rollback()  # a fresh view of pg_stat_activity
                time.sleep(0.05)
        assert [r["id"] for r in source.fetch(after, 3)] == [3, 4, 5]
    finally:
        source.close()


@pytest.mark.postgresql
def test_an_injected_connection_drop_reconnects_a_catch_up_too(pg: TestDatabase) -> None:
    # FaultySource's CONNECTION_DROP disposes the pool so the next fetch
    # reconnects; the connection a catch-up keeps is given back first (a pool
    # does not close a connection that is out), so it is closed as well.
    from dbtrigger.faults import Fault, FaultPlan, FaultySource  # noqa: PLC0415 - only here

    insert(pg, typed_table(pg), _plain_rows(range(9)))
    inner = SqlAlchemySource(
        url=pg.url,
        table="typed_rows",
        schema=pg.schema,
        cursor_column="updated_at",
        pk_columns=["id"],
        visibility="none",
    )
    plan = FaultPlan()
    source = FaultySource(inner, plan)
    try:
        source.fetch(BEGINNING, 3)
        first = source.fetch(BEGINNING, 3)
        assert inner.engine.pool.checkedout() == 1  # kept
        opened = _opened(inner)
        plan.add("fetch", Fault.CONNECTION_DROP)
        with pytest.raises(DbTriggerError, match="connection dropped"):
            source.fetch(BEGINNING, 3)
        assert inner.engine.pool.checkedout() == 0
        after = Position(first[-1]["updated_at"], {"id": first[-1]["id"]})
        assert [r["id"] for r in source.fetch(after, 3)] == [3, 4, 5]
        assert len(opened) == 1, "the fetch after the drop reconnected"
    finally:
        inner.close()


def _opened(source: SqlAlchemySource) -> list[int]:
    """A list that grows by one at every new DB-API connection of ``source``'s pool."""
    opened: list[int] = []
    sa.event.listen(source.engine, "connect", lambda *args: opened.append(1))
    return opened
