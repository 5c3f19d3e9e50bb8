"""A source's fetch gives up waiting for a lock instead of stalling without a word.

On PostgreSQL an ``ALTER TABLE`` of the watched table that waits for an
application's open transaction queues every reader of the table behind it: the
poller's fetch waited there for ever (still waiting after 15 s, going on only when
the application's transaction ended) while the heartbeat kept the lease, and
nothing was logged. MariaDB's read waited for the table's metadata lock up to
``lock_wait_timeout``, a day. The engine a source makes from its URL now bounds
lock waits at connect time (``lock_timeout_seconds``, 30 s by default): the fetch
fails as a retryable FetchError saying how long it waited, who holds locks on the
table, why a read waits at all and that the next tick tries again; once the
transaction and the DDL end, the next tick delivers every row. SQLite's readers do
not queue behind a writer (the tick reads on), and its busy timeout is the bound.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from dbtrigger import InMemoryCheckpointStore, PollTrigger, SqlAlchemySource
from dbtrigger.cursor import BEGINNING
from dbtrigger.errors import ConfigurationError, FetchError
from dbtrigger.runtime.retry import RetryPolicy
from tests.databases import TestDatabase
from tests.test_ddl_locks import outcome, transaction_on

#: How long a test lets a wait for the ALTER to queue (or to finish) last.
BOUNDED = 30.0


def orders(db: TestDatabase) -> None:
    db.execute(
        f"CREATE TABLE {db.qualified('orders')} "
        "(id INTEGER PRIMARY KEY, seq INTEGER NOT NULL, v INTEGER)"
    )


def insert(db: TestDatabase, ids: range) -> None:
    rows = [{"id": i, "seq": i, "v": 0} for i in ids]
    db.execute(f"INSERT INTO {db.qualified('orders')} (id, seq, v) VALUES (:id, :seq, :v)", rows)


def source_on(db: TestDatabase, **kwargs: Any) -> SqlAlchemySource:
    return SqlAlchemySource(
        url=db.url,
        table="orders",
        schema=db.schema,
        cursor_column="seq",
        pk_columns=["id"],
        visibility="none",  # the lock wait alone; a guard is no part of it
        **kwargs,
    )


#: The DDL each test queues behind an application's transaction.
ADD_COLUMN = "ADD COLUMN extra INTEGER"


@contextlib.contextmanager
def ddl_queued(
    db: TestDatabase,
    table: str,
    holding: contextlib.AbstractContextManager[None] | None = None,
) -> Iterator[None]:
    """An application's transaction open on ``table`` (``holding``; by default
    :func:`transaction_on`) and an ``ALTER TABLE ... ADD COLUMN`` of it queued
    behind that transaction (on SQLite: started, waiting for the write lock).
    Leaving the block ends the transaction and waits for the ALTER."""
    failed: list[BaseException] = []

    def alter() -> None:
        try:
            with db.engine.begin() as conn:
                conn.exec_driver_sql(f"ALTER TABLE {db.qualified(table)} {ADD_COLUMN}")
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=alter, daemon=True)
    with holding if holding is not None else transaction_on(db, table):
        thread.start()
        wait_until_queued(db, table)
        yield
    thread.join(BOUNDED)
    assert not thread.is_alive(), "the ALTER TABLE did not finish once the transaction ended"
    assert not failed, failed


def wait_until_queued(db: TestDatabase, table: str) -> None:
    """Until this test's ALTER waits for its lock (bounded); SQLite cannot say, and
    its readers do not queue behind it either way. (Matched by its whole text: any
    ALTER of another test waiting on the shared server said "queued" too early.)"""
    if db.kind == "sqlite":
        return
    statement = f"ALTER TABLE {db.qualified(table)} {ADD_COLUMN}"
    query = (
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
        "AND query = :statement"
        if db.kind == "postgresql"
        else "SELECT count(*) FROM information_schema.PROCESSLIST "
        "WHERE STATE LIKE 'Waiting for table metadata lock' AND INFO = :statement"
    )
    ready = threading.Event()
    for _ in range(300):  # bounded: 300 looks, 50 ms apart
        if db.scalar(query, {"statement": statement}):
            return
        ready.wait(0.05)
    pytest.fail("the ALTER TABLE never queued behind the open transaction")


def test_a_tick_behind_queued_ddl_gives_up_then_delivers_every_row(db: TestDatabase) -> None:
    orders(db)
    insert(db, range(1, 4))
    source = source_on(db, lock_timeout_seconds=1.0)
    trigger = PollTrigger(
        name="orders",
        source=source,
        checkpoint_store=InMemoryCheckpointStore(),
        batch_size=100,
        retry=RetryPolicy.none(),
    )
    delivered: list[int] = []

    def handler(events: Any) -> None:
        delivered.extend(e.pk["id"] for e in events)

    try:
        assert trigger.tick(handler) == 3  # reflected, a connection pooled
        insert(db, range(4, 7))
        result = outcome(ddl_queued(db, "orders"), lambda: trigger.tick(handler))
        if db.kind == "sqlite":
            assert result == 3  # a reader does not queue behind SQLite's writer
        else:
            assert isinstance(result, FetchError), repr(result)
            message = str(result)
            assert "fetch from " in message, message
            assert "waited 1 s for a lock on the table and gave up" in message, message
            assert "DDL on the table" in message, message
            assert "the next tick tries again" in message, message
            assert "ADD COLUMN" not in message, message  # no SQL of anyone's
            assert "SELECT" not in message, message
            if db.kind == "postgresql":
                assert "held by backend pid" in message, message
            assert delivered == [1, 2, 3]
        insert(db, range(7, 8))
        while trigger.tick(handler):  # bounded: the rows are there, each tick takes some
            pass
        assert sorted(delivered) == list(range(1, 8))
        assert len(delivered) == 7
    finally:
        source.close()


def bound_seen(db: TestDatabase, source: SqlAlchemySource) -> object:
    query = {
        "postgresql": "SHOW lock_timeout",
        "mariadb": "SELECT @@lock_wait_timeout",
        "sqlite": "PRAGMA busy_timeout",
    }[db.kind]
    with source.engine.connect() as conn:
        return conn.exec_driver_sql(query).scalar()


def test_the_source_engine_bounds_lock_waits_at_30_seconds(db: TestDatabase) -> None:
    orders(db)
    source = source_on(db)
    try:
        expected = {"postgresql": "30s", "mariadb": "30", "sqlite": "30000"}[db.kind]
        assert str(bound_seen(db, source)) == expected
    finally:
        source.close()


def test_a_shared_engine_or_their_own_bound_is_theirs(db: TestDatabase) -> None:
    orders(db)
    before = bound_seen(db, source_on(db, engine=db.engine))
    shared = source_on(db, engine=db.engine, lock_timeout_seconds=1.0)
    assert bound_seen(db, shared) == before  # the application's engine, as it was
    own = {
        "postgresql": {"options": "-c lock_timeout=7s"},
        "mariadb": {"init_command": "SET SESSION lock_wait_timeout = 7"},
        "sqlite": {"timeout": 7},
    }[db.kind]
    theirs = source_on(db, engine_kwargs={"connect_args": own}, lock_timeout_seconds=1.0)
    try:
        assert str(bound_seen(db, theirs)) in ("7s", "7", "7000")
    finally:
        theirs.close()


def test_the_bound_must_be_a_positive_number() -> None:
    for bad in (0, -1, float("inf"), "30"):
        with pytest.raises(ConfigurationError, match="lock_timeout_seconds"):
            SqlAlchemySource(
                url="sqlite://",
                table="t",
                cursor_column="c",
                pk_columns=["id"],
                lock_timeout_seconds=bad,  # type: ignore[arg-type]
            )


def test_a_lock_wait_on_a_shared_engine_is_told_too(pg: TestDatabase) -> None:
    """The application's own lock_timeout ran out: the same words, without a bound
    dbtrigger did not set."""
    orders(pg)
    engine = sa.create_engine(pg.url, connect_args={"options": "-c lock_timeout=1000"})
    source = source_on(pg, engine=engine)
    try:
        source.fetch(BEGINNING, 10)
        result = outcome(ddl_queued(pg, "orders"), lambda: source.fetch(BEGINNING, 10))
        assert isinstance(result, FetchError), repr(result)
        assert "gave up waiting (the engine's own lock timeout) for a lock on the table" in str(
            result
        )
    finally:
        source.close()
        engine.dispose()


def refusing_pooler(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """PostgreSQL connections through a pooler that refuses a lock bound in the startup
    options, as PgBouncer does; returns the options it refused, as they come."""
    import psycopg  # noqa: PLC0415 - PostgreSQL only
    from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg  # noqa: PLC0415

    original = PGDialect_psycopg.connect
    refused: list[str] = []

    def pooler(self: Any, *cargs: Any, **cparams: Any) -> Any:
        if "lock_timeout" in cparams.get("options", ""):
            refused.append(cparams["options"])
            raise psycopg.OperationalError("FATAL: unsupported startup parameter: options")
        return original(self, *cargs, **cparams)

    monkeypatch.setattr(PGDialect_psycopg, "connect", pooler)
    return refused


def test_a_pooler_that_refuses_the_bound_is_connected_to_without_it(
    pg: TestDatabase, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """PgBouncer (Azure's built-in pooler, Neon's) refuses ``-c lock_timeout`` in the
    startup options: every connection of the source would fail, a stall of its own.
    It connects without the bound instead, and says so once."""
    orders(pg)
    refused = refusing_pooler(monkeypatch)
    source = source_on(pg, engine_kwargs={"connect_args": {"options": "-c search_path=public"}})
    try:
        with caplog.at_level(logging.WARNING, logger="dbtrigger"):
            assert source.fetch(BEGINNING, 10) == []
            with source.engine.connect() as one, source.engine.connect() as two:
                seen = [c.exec_driver_sql("SHOW search_path").scalar() for c in (one, two)]
        assert seen == ["public", "public"]  # their options kept
        assert len(refused) == 1  # asked once, not at every connection
        [warning] = [r for r in caplog.records if getattr(r, "event", "") == "lock_bound_refused"]
        assert "ALTER ROLE" in warning.getMessage()
    finally:
        source.close()
