"""The change log's prune, snapshot and reader registry, the dead-letter marks and
the transaction-id column give up waiting for a lock, as every other write of
dbtrigger does.

Each ran in a transaction with the session's own lock wait: unbounded on
PostgreSQL (``lock_timeout = 0``), 50 s for a row on MariaDB. The prune runs after
a poller's commit (``ChangeLogSource(prune_passed_by=...)``): behind a transaction
holding log rows, the poller's tick hung there, its heartbeat keeping the lease,
and said nothing. The dead-letter commands (``deadletter discard``/``replay``)
hung likewise, and ``install_visibility_trigger`` queued every later reader and
writer of the table behind its ``ALTER TABLE``. Now each waits at most its bound
and fails with a retryable error naming the table and who holds locks there.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dbtrigger import PollTrigger
from dbtrigger.changelog import operations as changelog_operations
from dbtrigger.changelog import pruning, registration
from dbtrigger.changelog.ddl import log_table_name
from dbtrigger.changelog.readers import readers_table_name
from dbtrigger.changelog.snapshot import snapshot
from dbtrigger.changelog.source import ChangeLogSource
from dbtrigger.cli.main import main as cli_main
from dbtrigger.errors import QuarantineError, RetryableError
from dbtrigger.quarantine import SqlQuarantineSink
from dbtrigger.replay.dead_letters import Mark, SqlMarks
from dbtrigger.sources.visibility import install_visibility_trigger
from dbtrigger.state.stores.file import FileCheckpointStore
from tests.databases import TestDatabase
from tests.test_ddl_locks import gave_up, outcome, row_locked
from tests.test_store_locks import quarantine_record

WAITED = "waited 1 s for a lock another transaction holds on the table"


@contextlib.contextmanager
def rows_held(db: TestDatabase, table: str, *, no_inserts: bool = False) -> Iterator[None]:
    """Another transaction holds every row of ``table`` (and, on MariaDB, the gaps
    between them; on SQLite: the database's write lock). ``no_inserts``: on
    PostgreSQL it holds the table in SHARE mode, as a ``CREATE INDEX`` does."""
    holder = db.engine.connect()
    try:
        if db.kind == "sqlite":
            holder.exec_driver_sql("BEGIN IMMEDIATE")
        elif no_inserts and db.kind == "postgresql":
            holder.begin()
            holder.exec_driver_sql(f"LOCK TABLE {db.qualified(table)} IN SHARE MODE")
        else:
            holder.begin()
            holder.exec_driver_sql(f"SELECT * FROM {db.qualified(table)} FOR UPDATE").fetchall()
        yield
    finally:
        holder.rollback()
        holder.close()


def orders_with_log(db: TestDatabase, rows: int) -> str:
    orders = db.qualified("orders")
    db.execute(f"CREATE TABLE {orders} (id INTEGER PRIMARY KEY, v INTEGER)")
    changelog_operations.install(db.engine, "orders", schema=db.schema)
    for i in range(1, rows + 1):
        db.execute(f"INSERT INTO {orders} VALUES ({i}, {i})")
    return orders


def delivered_within(trigger: PollTrigger, handler: Any, rows: int = 5, seconds: float = 90) -> int:
    """Ticks until ``rows`` were delivered (bounded): on MariaDB the visibility guard
    holds the rows back while any transaction open on the shared server when it
    looked is still open, other tests' too."""
    delivered, deadline = 0, time.monotonic() + seconds
    while delivered < rows and time.monotonic() < deadline:
        delivered += trigger.tick(handler)
        if delivered < rows:
            time.sleep(0.05)
    return delivered


def test_a_prune_after_a_commit_behind_held_log_rows_gives_up_and_the_tick_returns(
    db: TestDatabase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two pollers read the log, ``reader`` prunes what both passed. Behind another
    transaction holding the passed rows its tick returns after the bound, with a
    warning; once that transaction ended, the next tick prunes."""
    monkeypatch.setattr(pruning, "PRUNE_LOCK_TIMEOUT", 1.0)
    monkeypatch.setattr(registration, "LOCK_TIMEOUT", 1.0)  # SQLite: one lock
    orders_with_log(db, 5)
    log = db.qualified(log_table_name("orders"))
    store = FileCheckpointStore(tmp_path / "state")
    source = ChangeLogSource(
        url=db.url,
        table="orders",
        schema=db.schema,
        prune_passed_by=["reader", "other"],
        prune_store=store,
        prune_every_seconds=0.001,
    )
    other_source = ChangeLogSource(url=db.url, table="orders", schema=db.schema)
    poller = PollTrigger(name="reader", source=source, checkpoint_store=store)
    other = PollTrigger(name="other", source=other_source, checkpoint_store=store)
    seen: list[int] = []
    try:
        assert delivered_within(poller, lambda events: seen.extend(e.pk["id"] for e in events)) == 5
        assert delivered_within(other, lambda events: None) == 5
        assert db.scalar(f"SELECT count(*) FROM {log}") == 5  # "other" had no checkpoint
        with caplog.at_level(logging.WARNING, logger="dbtrigger"):
            delivered = outcome(
                rows_held(db, log_table_name("orders")), lambda: poller.tick(lambda events: None)
            )
        assert delivered == 0, delivered
        failed = [r for r in caplog.records if r.__dict__.get("event") == "changelog_prune_failed"]
        assert failed, [r.getMessage() for r in caplog.records]
        message = failed[0].getMessage()
        assert WAITED in message, message
        assert log_table_name("orders") in message, message
        assert db.scalar(f"SELECT count(*) FROM {log}") == 5  # nothing deleted
        assert poller.tick(lambda events: None) == 0
        assert db.scalar(f"SELECT count(*) FROM {log}") == 0  # once it ended, it prunes
        assert seen == [1, 2, 3, 4, 5]
    finally:
        for trigger in (poller, other):
            trigger.close()
        source.close()
        other_source.close()


def test_an_operators_prune_behind_held_log_rows_gives_up_and_deletes_nothing(
    db: TestDatabase,
) -> None:
    orders_with_log(db, 4)
    log = db.qualified(log_table_name("orders"))
    top = db.scalar(f"SELECT max(dbt_seq) FROM {log}")
    error = outcome(
        rows_held(db, log_table_name("orders")),
        lambda: changelog_operations.prune(
            db.engine, "orders", schema=db.schema, up_to_seq=top, lock_timeout_seconds=1
        ),
    )
    message = gave_up(error, RetryableError, log_table_name("orders"))
    assert message.startswith("pruning the change log of orders (dbt_changelog_orders) waited 1 s")
    assert "0 row(s) deleted before stay deleted" in message, message
    assert db.scalar(f"SELECT count(*) FROM {log}") == 4
    assert changelog_operations.prune(db.engine, "orders", schema=db.schema, up_to_seq=top) == 4


def mark(event_id: str) -> Mark:
    at = dt.datetime(2026, 1, 2, tzinfo=dt.timezone.utc)
    return Mark("orders", event_id, "discarded", at, "me", "tested", "")


def test_dead_letter_marks_and_deletes_behind_a_held_lock_give_up(db: TestDatabase) -> None:
    sink = SqlQuarantineSink(url=db.url, schema=db.schema, lock_timeout_seconds=1)
    marks = SqlMarks(sink)
    try:
        sink.put([quarantine_record()])
        marks.add([mark("e0")])  # the marks table: there
        error = outcome(
            rows_held(db, marks.table.name, no_inserts=True), lambda: marks.add([mark("e1")])
        )
        message = gave_up(error, QuarantineError, marks.table.name)
        assert "no mark was written" in message, message
        assert [m.event_id for m in marks.read()] == ["e0"]
        error = outcome(
            rows_held(db, sink.table.name), lambda: marks.delete_records("orders", {"e1"})
        )
        message = gave_up(error, QuarantineError, sink.table.name)
        assert "no record was deleted" in message, message
        assert [r.event_id for r in sink.records("orders")] == ["e1"]
        assert marks.delete_records("orders", {"e1"}) == 1  # once it ended
        assert sink.records("orders") == []
    finally:
        sink.close()


@pytest.mark.postgresql
def test_the_transaction_id_column_behind_an_open_transaction_gives_up(pg: TestDatabase) -> None:
    """Its ``ALTER TABLE`` waited for every transaction open on the table, with every
    later reader and writer of the table queued behind it."""
    orders = pg.qualified("orders")
    pg.execute(f"CREATE TABLE {orders} (id INTEGER PRIMARY KEY, v INTEGER)")
    pg.execute(f"INSERT INTO {orders} VALUES (1, 1)")
    error = outcome(
        rows_held(pg, "orders"),
        lambda: install_visibility_trigger(
            pg.engine, "orders", schema=pg.schema, lock_timeout_seconds=1
        ),
    )
    message = gave_up(error, RetryableError, "orders")
    assert message.startswith("adding the transaction-id column to orders waited 1 s"), message
    assert "held by backend pid" in message, message
    columns = pg.scalar(
        "SELECT count(*) FROM information_schema.columns WHERE table_schema = "
        f"'{pg.schema}' AND table_name = 'orders' AND column_name = 'dbtrigger_xid'"
    )
    assert columns == 0  # nothing changed
    assert install_visibility_trigger(pg.engine, "orders", schema=pg.schema) == "dbtrigger_xid"


@pytest.fixture
def commands_wait_one_second(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(changelog_operations, "INSTALL_LOCK_TIMEOUT", 1.0)


@pytest.mark.usefixtures("commands_wait_one_second")
def test_a_snapshot_behind_an_applications_row_lock_gives_up(db: TestDatabase) -> None:
    """A chunk's ``INSERT ... SELECT`` share-locks the rows it reads: behind a row an
    application is changing it waited for ever on PostgreSQL, holding the rows it
    had locked so far (and their writers) behind it."""
    orders = orders_with_log(db, 5)
    log = db.qualified(log_table_name("orders"))
    logged = f"SELECT count(*) FROM {log} WHERE dbt_before IS NULL AND dbt_op = 'upsert'"
    inserts = db.scalar(logged)  # the triggers' own entries of the five inserts
    error = outcome(
        row_locked(db, "orders", "v = v WHERE id = 3"),
        lambda: snapshot(db.engine, "orders", schema=db.schema),
    )
    message = gave_up(error, RetryableError, "orders")
    assert message.startswith("snapshotting orders waited 1 s"), message
    assert "0 row(s) in 0 chunk(s) written before stay in the log" in message, message
    assert db.scalar(logged) == inserts  # nothing written
    assert snapshot(db.engine, "orders", schema=db.schema).rows == 5  # once it ended
    assert db.scalar(logged) == inserts + 5
    assert db.scalar(f"SELECT count(*) FROM {orders}") == 5


@pytest.mark.usefixtures("commands_wait_one_second")
def test_forgetting_a_reader_behind_its_held_registry_row_gives_up(
    db: TestDatabase, capsys: pytest.CaptureFixture[str]
) -> None:
    orders_with_log(db, 1)
    source = ChangeLogSource(url=db.url, table="orders", schema=db.schema)
    try:
        source.bind_poller("p")
        source._register(1, first=True)
    finally:
        source.close()
    where = ["--url", db.url, "--table", "orders", *(["--schema", db.schema] if db.schema else [])]
    forget = ["changelog", "readers", *where, "--forget", "p", "--yes"]
    registry = readers_table_name("orders")
    code = outcome(
        row_locked(db, registry, "seen_at = seen_at WHERE reader = 'p'"), lambda: cli_main(forget)
    )
    assert code == 2, capsys.readouterr()
    error = capsys.readouterr().err
    assert "error: changing the reader registry of orders waited 1 s for a lock" in error, error
    assert cli_main(forget) == 0  # once it ended
    assert "forgot reader p" in capsys.readouterr().out
