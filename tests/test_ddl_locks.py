"""DDL dbtrigger runs inside a tick gives up waiting for a lock, as its writes do.

A SQL checkpoint store, the SQL history and a SQL quarantine create their table at
its first write, and a BinlogSource creates (or adds columns to) its control tables
when it sets up. Each ran that DDL, and the existence check before it, with the
session's own lock wait: behind another session creating the same table (a
transaction left open on PostgreSQL, a ``CREATE TABLE ... SELECT`` still running on
MariaDB) or a transaction open on the table, PostgreSQL waited for ever
(``lock_timeout = 0``) and MariaDB its ``lock_wait_timeout``, a day. The tick hung
there and said nothing. Now each waits at most its lock bound (the store's
``lock_timeout_seconds``, 10 s by default) and fails with a retryable error naming
the table; the next try, once the lock is gone, creates it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from dbtrigger.cdc import binlog_control as control
from dbtrigger.cdc.binlog_setup import connect
from dbtrigger.changelog import operations as changelog_operations
from dbtrigger.changelog import registration
from dbtrigger.changelog.readers import readers_table_name, registered
from dbtrigger.changelog.source import ChangeLogSource
from dbtrigger.cli.main import main as cli_main
from dbtrigger.errors import FetchError, QuarantineError, RetryableError, StoreUnavailableError
from dbtrigger.history.derive import history_for
from dbtrigger.quarantine import SqlQuarantineSink
from dbtrigger.state.stores.sql import SqlCheckpointStore
from dbtrigger.wakeup import ddl as wake_ddl
from tests.databases import TestDatabase
from tests.test_store_locks import quarantine_record

#: How long a test lets the call wait before it calls it hung (the bound is 1 s).
GIVE_UP_WITHIN = 25.0


@contextlib.contextmanager
def ddl_blocked(db: TestDatabase, table: str) -> Iterator[None]:
    """Another session holds what creating ``table`` needs: on PostgreSQL a
    transaction that creates it too and stays open; on MariaDB (whose DDL commits at
    once) a ``CREATE TABLE ... SELECT`` of it that is still running; on SQLite a
    write transaction."""
    if db.kind == "mariadb":
        with creating_slowly(db, table):
            yield
        return
    holder = db.engine.connect()
    try:
        if db.kind == "postgresql":
            holder.begin()
            holder.exec_driver_sql(f"CREATE TABLE {db.qualified(table)} (x int)")
        else:
            holder.exec_driver_sql("BEGIN IMMEDIATE")
        yield
    finally:
        holder.rollback()
        holder.close()


@contextlib.contextmanager
def creating_slowly(db: TestDatabase, table: str) -> Iterator[None]:
    """MariaDB: another session's ``CREATE TABLE ... SELECT SLEEP(...)`` holds the
    table name's exclusive metadata lock until it is killed at the end of the block."""
    holder = db.engine.connect()
    ident = holder.exec_driver_sql("SELECT CONNECTION_ID()").scalar()
    statement = f"CREATE TABLE {db.qualified(table)} (x int) SELECT SLEEP(60) AS x"
    thread = threading.Thread(target=_run_quietly, args=(holder, statement), daemon=True)
    thread.start()
    try:
        with db.engine.connect() as watcher:
            for _ in range(200):  # until it runs (bounded: 200 looks, 50 ms apart)
                running = watcher.exec_driver_sql(
                    f"SELECT STATE FROM information_schema.PROCESSLIST WHERE ID = {ident}"
                ).scalar()
                if running == "User sleep":
                    break
                thread.join(0.05)
            assert running == "User sleep", running
        yield
    finally:
        with db.engine.connect() as killer:
            killer.exec_driver_sql(f"KILL QUERY {ident}")
        thread.join(30)
        holder.close()


def _run_quietly(conn: sa.Connection, statement: str) -> None:
    with contextlib.suppress(sa.exc.DBAPIError):  # killed at the end of the block
        conn.exec_driver_sql(statement)


def outcome(hold: contextlib.AbstractContextManager[Any], call: Callable[[], Any]) -> Any:
    """What ``call`` returned or raised, run while ``hold`` is held; fails the test
    when it was still waiting after :data:`GIVE_UP_WITHIN` seconds."""
    result: list[Any] = []

    def run() -> None:
        try:
            result.append(call())
        except BaseException as exc:
            result.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    with hold:
        thread.start()
        thread.join(GIVE_UP_WITHIN)
        waited = thread.is_alive()
    thread.join(60)
    assert not waited, f"the DDL still waited for the lock after {GIVE_UP_WITHIN:g} s"
    [value] = result
    return value


def gave_up(error: object, kind: type[BaseException], table: str) -> str:
    assert isinstance(error, kind), repr(error)
    assert isinstance(error, RetryableError), repr(error)
    message = str(error)
    assert table in message, message
    assert "waited 1 s for a lock another transaction holds on the table" in message, message
    return message


def test_a_state_table_created_behind_a_lock_gives_up(db: TestDatabase) -> None:
    store = SqlCheckpointStore(url=db.url, schema=db.schema, lock_timeout_seconds=1)
    try:
        error = outcome(
            ddl_blocked(db, "dbtrigger_state"),
            lambda: store.write("orders", b'{"v": 1}', if_match=None),
        )
        message = gave_up(error, StoreUnavailableError, "dbtrigger_state")
        assert message.startswith("create table of '"), message
        etag = store.write("orders", b'{"v": 1}', if_match=None)  # the next try creates it
        found = store.read("orders")
        assert found is not None
        assert found.etag == etag
    finally:
        store.close()


def test_a_history_table_created_behind_a_lock_gives_up(db: TestDatabase) -> None:
    store = SqlCheckpointStore(url=db.url, schema=db.schema, lock_timeout_seconds=1)
    history = history_for(store)
    assert history is not None
    record = {"type": "commit", "at": "2026-01-01T00:00:00Z", "batch_id": "b1", "id": "r1"}
    try:
        store.write("orders", b'{"v": 1}', if_match=None)  # the state table: there
        error = outcome(
            ddl_blocked(db, "dbtrigger_state_history"),
            lambda: history.append("orders", [record], after_seq=0),
        )
        gave_up(error, StoreUnavailableError, "dbtrigger_state_history")
        history.append("orders", [record], after_seq=0)
        assert [r["seq"] for r in history.read("orders")] == [1]
    finally:
        store.close()


def test_a_quarantine_table_created_behind_a_lock_gives_up(db: TestDatabase) -> None:
    sink = SqlQuarantineSink(url=db.url, schema=db.schema, lock_timeout_seconds=1)
    record = quarantine_record()
    try:
        error = outcome(ddl_blocked(db, "dbtrigger_quarantine"), lambda: sink.put([record]))
        gave_up(error, QuarantineError, "dbtrigger_quarantine")
        sink.put([record])
        assert [r.event_id for r in sink.records("orders")] == ["e1"]
    finally:
        sink.close()


@pytest.fixture
def one_second(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(control, "DDL_LOCK_WAIT_SECONDS", 1.0, raising=False)


@pytest.mark.mariadb
@pytest.mark.usefixtures("one_second")
def test_binlog_control_tables_created_behind_another_creation_give_up(
    mariadb: TestDatabase,
) -> None:
    db = mariadb
    assert db.schema is not None
    conn = connect(sa.make_url(db.url), database=False)
    try:
        error = outcome(ddl_blocked(db, control.TABLE), lambda: control.ensure(conn, db.schema))
        assert isinstance(error, FetchError), repr(error)
        message = str(error)
        assert f"creating {db.schema}.{control.TABLE} waited 1 s for a metadata lock" in message
        assert "another session holds" in message, message
        assert conn.open
        assert control.ensure(conn, db.schema) is True  # the next tick creates them
        with conn.cursor() as cur:
            cur.execute("SELECT @@SESSION.lock_wait_timeout")
            assert cur.fetchone()[0] == 86400  # the session's own bound, set back
    finally:
        conn.close()


@pytest.mark.mariadb
@pytest.mark.usefixtures("one_second")
def test_binlog_control_upgrade_behind_an_open_transaction_gives_up(
    mariadb: TestDatabase,
) -> None:
    db = mariadb
    assert db.schema is not None
    conn = connect(sa.make_url(db.url), database=False)
    try:
        control.ensure(conn, db.schema)
        with conn.cursor() as cur:  # a table made by a version before the marks
            cur.execute(f"ALTER TABLE `{db.schema}`.`{control.TABLE}` DROP COLUMN generation")

        # Another worker's transaction that read the table, still open.
        reading = holding(db, f"SELECT * FROM `{db.schema}`.`{control.TABLE}`")
        error = outcome(reading, lambda: control.ensure(conn, db.schema))
        assert isinstance(error, FetchError), repr(error)
        assert f"adding columns to {db.schema}.{control.TABLE} waited 1 s" in str(error)
        assert control.ensure(conn, db.schema) is False
        assert control.upgrade_sql(conn, db.schema) is None  # upgraded once it could
    finally:
        conn.close()


@pytest.fixture
def install_waits_one_second(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(changelog_operations, "INSTALL_LOCK_TIMEOUT", 1.0, raising=False)


@contextlib.contextmanager
def holding(db: TestDatabase, statement: str) -> Iterator[None]:
    """An application's transaction that ran ``statement`` and stays open: the
    locks that statement took are held until the block ends (rolled back)."""
    holder = db.engine.connect()
    try:
        holder.begin()
        result = holder.exec_driver_sql(statement)
        if result.returns_rows:
            result.fetchall()
        yield
    finally:
        holder.rollback()
        holder.close()


@contextlib.contextmanager
def transaction_on(db: TestDatabase, table: str) -> Iterator[None]:
    """An application's transaction open on ``table`` (PostgreSQL: it wrote there,
    MariaDB: it read it, SQLite: it holds the write lock)."""
    holder = db.engine.connect()
    try:
        if db.kind == "postgresql":
            holder.begin()
            holder.exec_driver_sql(f"UPDATE {db.qualified(table)} SET v = v")
        elif db.kind == "mariadb":
            holder.begin()
            holder.exec_driver_sql(f"SELECT * FROM {db.qualified(table)}").fetchall()
        else:
            holder.exec_driver_sql("BEGIN IMMEDIATE")
        yield
    finally:
        holder.rollback()
        holder.close()


@pytest.mark.usefixtures("install_waits_one_second")
def test_changelog_install_behind_an_open_transaction_gives_up(
    db: TestDatabase, capsys: pytest.CaptureFixture[str]
) -> None:
    """``dbtrigger changelog install`` behind an application's open transaction on the
    table: PostgreSQL's DROP/CREATE TRIGGER waited for ever (and every later reader
    and writer of the table queued behind it), MariaDB's a day."""
    db.execute(f"CREATE TABLE {db.qualified('orders')} (id INTEGER PRIMARY KEY, v INTEGER)")
    where = ["--url", db.url, "--table", "orders", *(["--schema", db.schema] if db.schema else [])]
    code = outcome(
        transaction_on(db, "orders"), lambda: cli_main(["changelog", "install", *where, "--yes"])
    )
    assert code == 2, capsys.readouterr()
    error = capsys.readouterr().err
    assert "error: changing the change log triggers of orders waited 1 s for a lock" in error
    assert cli_main(["changelog", "install", *where, "--yes"]) == 0  # once it ended
    assert changelog_operations.is_installed(db.engine, "orders", schema=db.schema)


@contextlib.contextmanager
def row_locked(db: TestDatabase, table: str, where: str) -> Iterator[None]:
    """Another transaction holds a row of ``table`` (SQLite: the write lock)."""
    holder = db.engine.connect()
    try:
        if db.kind == "sqlite":
            holder.exec_driver_sql("BEGIN IMMEDIATE")
        else:
            holder.begin()
            holder.exec_driver_sql(f"UPDATE {db.qualified(table)} SET {where}")
        yield
    finally:
        holder.rollback()
        holder.close()


def test_changelog_reader_registry_behind_a_row_lock_gives_up(
    db: TestDatabase, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A change log's reader records its position at its checkpoints: behind another
    transaction holding its registry row that write waited for ever on PostgreSQL
    (50 s on MariaDB), in the tick. Now it gives up after its bound and says so."""
    monkeypatch.setattr(registration, "LOCK_TIMEOUT", 1.0)
    db.execute(f"CREATE TABLE {db.qualified('orders')} (id INTEGER PRIMARY KEY, v INTEGER)")
    changelog_operations.install(db.engine, "orders", schema=db.schema)
    source = ChangeLogSource(url=db.url, table="orders", schema=db.schema)
    try:
        source.bind_poller("p")
        registry = readers_table_name("orders")
        source._register(1, first=True)
        held = row_locked(db, registry, "seen_at = seen_at WHERE reader = 'p'")
        with caplog.at_level(logging.WARNING, logger="dbtrigger.changelog"):
            assert outcome(held, lambda: source._register(2, first=True)) is None  # no raise
        events = [r.__dict__.get("event") for r in caplog.records if r.levelno >= logging.WARNING]
        assert events == ["changelog_reader_waiting", "changelog_reader_unregistered"], events
        warning = caplog.records[-1]
        message = warning.getMessage()
        assert "waited 1 s for a lock another transaction holds on the table" in message, message
        assert "UPDATE" not in message, message  # no SQL text
        source._register(2, first=True)  # once it ended
        with db.engine.connect() as conn:
            assert [(r.name, r.seq) for r in registered(conn, "orders", db.schema) or []] == [
                ("p", 2)
            ]
    finally:
        source.close()


@pytest.mark.postgresql
def test_wake_install_behind_an_open_transaction_gives_up(
    pg: TestDatabase, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``dbtrigger wake install`` behind an application's open transaction on the table:
    its DROP TRIGGER waited for ever, and every later reader and writer of the table
    queued behind it."""
    monkeypatch.setattr(wake_ddl, "INSTALL_LOCK_TIMEOUT", 1.0, raising=False)
    pg.execute(f"CREATE TABLE {pg.qualified('orders')} (id INTEGER PRIMARY KEY, v INTEGER)")
    where = ["--url", pg.url, "--table", "orders", "--schema", str(pg.schema)]
    code = outcome(
        transaction_on(pg, "orders"), lambda: cli_main(["wake", "install", *where, "--yes"])
    )
    assert code == 2, capsys.readouterr()
    error = capsys.readouterr().err
    assert "error: changing the wake-up trigger of orders waited 1 s for a lock" in error, error
    assert "held by backend pid" in error, error
    assert cli_main(["wake", "install", *where, "--yes"]) == 0  # once it ended
    assert wake_ddl.installed_channel(pg.engine, "orders", schema=pg.schema) is not None
