"""A write behind another transaction's lock gives up in bounded time, on every database.

At default settings PostgreSQL waited for ever (``lock_timeout = 0``), MariaDB 50 s
for a row lock and a day for a table's metadata lock, SQLite 5 s: a tick whose
output write waited hung silently, and with ``handler_timeout_seconds`` its lease
lapsed, another instance delivered the batch again, and the waiting write could
still land afterwards. Now every write transaction bounds its lock waits
(``lock_timeout_seconds``, 30 s by default, at most a quarter of a trigger's lease)
and gives up with ``OutputLockTimeoutError``, retryable, naming the table and,
where the database can tell, who holds the lock. A thread runs the write; the test
waits for its outcome with a bound and ends the holder's transaction in any case.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from dbtrigger import DbBindings, DbOut, HandlerError, RowChange, SqlAlchemySource
from dbtrigger.azure import binding_of
from dbtrigger.dbio import DbWriter
from dbtrigger.errors import ConfigurationError, OutputLockTimeoutError, RetryableError
from dbtrigger.output import OutputTarget
from dbtrigger.state.stores.memory import InMemoryCheckpointStore
from tests.databases import TestDatabase

#: Longest a bounded write may take here (its bound is 1 or 2 s): far below
#: MariaDB's 50 s default and PostgreSQL's "for ever".
GIVE_UP_WITHIN = 25.0


def outcome_of(call: Callable[[], Any]) -> tuple[threading.Thread, list[Any], float]:
    outcome: list[Any] = []
    started = time.monotonic()

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome, started


class Holder:
    """Another session with an open transaction that locked row 1 of ``table``
    (on SQLite: the database file's write lock)."""

    def __init__(self, db: TestDatabase, table: str) -> None:
        self.conn = db.engine.connect()
        self.conn.begin()
        self.conn.exec_driver_sql(f"UPDATE {db.qualified(table)} SET v = 9 WHERE id = 1")
        self.ident: Any = None
        if db.kind == "postgresql":
            self.ident = self.conn.exec_driver_sql("SELECT pg_backend_pid()").scalar()
        elif db.kind == "mariadb":
            self.ident = self.conn.exec_driver_sql("SELECT CONNECTION_ID()").scalar()

    def release(self) -> None:
        self.conn.rollback()
        self.conn.close()


@pytest.fixture
def locked(db: TestDatabase) -> Iterator[tuple[TestDatabase, Holder]]:
    db.execute(f"CREATE TABLE {db.qualified('lk_sink')} (id INTEGER PRIMARY KEY, v INTEGER)")
    db.execute(f"INSERT INTO {db.qualified('lk_sink')} VALUES (1, 0)")
    # the trigger test's source, made before the lock is held (SQLite locks the file)
    db.execute(f"CREATE TABLE {db.qualified('lk_src')} (id INTEGER PRIMARY KEY, seq INTEGER)")
    db.execute(f"INSERT INTO {db.qualified('lk_src')} VALUES (1, 1)")
    holder = Holder(db, "lk_sink")
    try:
        yield db, holder
    finally:
        holder.release()


def check_gave_up(db: TestDatabase, holder: Holder, call: Callable[[], Any]) -> str:
    thread, outcome, started = outcome_of(call)
    thread.join(GIVE_UP_WITHIN)
    alive = thread.is_alive()
    holder.release() if alive else None
    thread.join(60)
    assert not alive, f"the write still waited for the lock after {GIVE_UP_WITHIN} s"
    elapsed = time.monotonic() - started
    [error] = outcome
    assert isinstance(error, OutputLockTimeoutError), repr(error)
    assert isinstance(error, RetryableError)
    message = str(error)
    assert "lk_sink" in message, message
    assert "gave up" in message, message
    if db.kind == "postgresql":
        assert f"backend pid {holder.ident}" in message, message
    elif db.kind == "mariadb":
        assert f"connection {holder.ident}" in message, message
    else:
        assert "write lock" in message, message
    assert elapsed < GIVE_UP_WITHIN
    return message


@pytest.mark.parametrize("binding", ["db.output", "DbWriter", "DbWriter.transaction"])
def test_a_write_behind_a_held_lock_gives_up(
    locked: tuple[TestDatabase, Holder], binding: str
) -> None:
    db, holder = locked
    rows = [{"id": 2, "v": 2}, {"id": 1, "v": 1}]
    if binding == "db.output":
        target = OutputTarget(
            url=db.url,
            table="lk_sink",
            schema=db.schema,
            action="upsert",
            conflict_columns=["id"],
            lock_timeout_seconds=1,
        )

        def call() -> Any:
            try:
                return target.write(rows)
            finally:
                target.close()

    else:
        writer = DbWriter(url=db.url, table="lk_sink", schema=db.schema, lock_timeout_seconds=1)

        def call() -> Any:
            try:
                if binding == "DbWriter":
                    return writer.upsert_many(rows=rows, conflict_columns=["id"])
                with writer.transaction() as tx:
                    tx.insert(data={"id": 3, "v": 3})
                    return tx.update(data={"v": 1}, pk={"id": 1})
            finally:
                writer.close()

    check_gave_up(db, holder, call)
    holder.release()
    with db.engine.connect() as conn:  # nothing of the write landed
        got = conn.exec_driver_sql(f"SELECT id, v FROM {db.qualified('lk_sink')}").fetchall()
    assert [tuple(r) for r in got] == [(1, 0)]


def test_the_bound_is_set_back_on_a_shared_engine(locked: tuple[TestDatabase, Holder]) -> None:
    """A bounded write leaves the session settings of a connection it borrowed from
    the caller's engine as they were (MariaDB and SQLite set them per session)."""
    db, holder = locked
    holder.release()
    engine = sa.create_engine(db.url, pool_size=1, max_overflow=0)
    probe = {
        "postgresql": "SHOW lock_timeout",
        "mariadb": "SELECT @@SESSION.innodb_lock_wait_timeout, @@SESSION.lock_wait_timeout",
        "sqlite": "PRAGMA busy_timeout",
    }[db.kind]
    try:
        with engine.connect() as conn:
            before = tuple(conn.exec_driver_sql(probe).one())
        writer = DbWriter(engine=engine, table="lk_sink", schema=db.schema, lock_timeout_seconds=3)
        writer.insert(data={"id": 5, "v": 5})
        with engine.connect() as conn:
            assert tuple(conn.exec_driver_sql(probe).one()) == before
    finally:
        engine.dispose()


def test_under_a_trigger_the_default_bound_fits_the_lease(
    locked: tuple[TestDatabase, Holder], request: pytest.FixtureRequest
) -> None:
    """With lease_ttl_seconds=8 the default bound becomes 2 s (a quarter of the lease):
    the tick fails in time with the typed error, and the batch comes again later."""
    db, holder = locked
    source = SqlAlchemySource(
        url=db.url,
        table="lk_src",
        schema=db.schema,
        cursor_column="seq",
        pk_columns=["id"],
        visibility="none",  # the holder's open transaction would hold the poller back
    )
    request.addfinalizer(source.close)
    store = InMemoryCheckpointStore()
    bindings = DbBindings()

    @bindings.trigger(
        arg_name="events", source=source, checkpoint_store=store, name="lk", lease_ttl_seconds=8
    )
    @bindings.output(
        "out",
        url=db.url,
        table="lk_sink",
        schema=db.schema,
        action="upsert",
        conflict_columns=["id"],
    )
    def poll(timer: object, events: list[RowChange], out: DbOut) -> None:
        out.set([{"id": e.pk["id"], "v": 7} for e in events])

    output = binding_of(poll).output
    assert output is not None
    request.addfinalizer(output.close)
    target = bindings.triggers["lk"]
    thread, outcome, _ = outcome_of(lambda: poll(timer=None))
    thread.join(GIVE_UP_WITHIN)
    alive = thread.is_alive()
    holder.release()
    thread.join(60)
    assert not alive, "the tick still waited for the lock"
    [error] = outcome
    assert isinstance(error, HandlerError), repr(error)
    assert isinstance(error.__cause__, OutputLockTimeoutError), repr(error.__cause__)
    assert "waited 2 s" in str(error.__cause__)
    assert target.read_state().position.cursor is None  # not committed: delivered again
    poll(timer=None)
    with db.engine.connect() as conn:
        got = conn.exec_driver_sql(f"SELECT id, v FROM {db.qualified('lk_sink')}").fetchall()
    assert sorted(tuple(r) for r in got) == [(1, 7)]


def test_a_bound_longer_than_the_lease_allows_is_refused(sqlite_db: TestDatabase) -> None:
    bindings = DbBindings()
    source = SqlAlchemySource(url=sqlite_db.url, table="t", cursor_column="seq", pk_columns=["id"])
    with pytest.raises(ConfigurationError, match=r"lock_timeout_seconds=60 .* at most 30"):

        @bindings.trigger(
            arg_name="events", source=source, checkpoint_store=InMemoryCheckpointStore()
        )
        @bindings.output("out", url=sqlite_db.url, table="t", lock_timeout_seconds=60)
        def poll(timer: object, events: list[RowChange], out: DbOut) -> None:
            pass

    for wrong in (0, -1, float("inf"), "30"):
        with pytest.raises(ConfigurationError, match="lock_timeout_seconds"):
            DbWriter(url=sqlite_db.url, table="t", lock_timeout_seconds=wrong)  # type: ignore[arg-type]
