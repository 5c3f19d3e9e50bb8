"""The SQL checkpoint store's and the SQL history's writes give up waiting for a lock.

A transaction left open on the state row (an operator's ``SELECT ... FOR UPDATE``, a
process frozen mid-write) made a lease renewal or a commit wait for ever on
PostgreSQL at its defaults (``lock_timeout = 0``), 50 s on MariaDB: the heartbeat
hung with it and the tick said nothing. An append of the history behind another
writer's uncommitted append of the same record waited likewise. Now both wait at
most ``lock_timeout_seconds`` (10 s by default) and fail as
``StoreUnavailableError``, retryable, nothing changed, naming who holds the lock
where the database can tell.
"""

from __future__ import annotations

import datetime as dt
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

from dbtrigger.errors import QuarantineError, StoreUnavailableError
from dbtrigger.history.derive import history_for
from dbtrigger.quarantine import QuarantineRecord, SqlQuarantineSink, quarantine_table
from dbtrigger.state.stores.sql import SqlCheckpointStore
from tests.databases import TestDatabase

GIVE_UP_WITHIN = 25.0


def gives_up(db: TestDatabase, holder: sa.Connection, call: Callable[[], Any]) -> str:
    """Run ``call`` while ``holder`` keeps its transaction open; its error's text."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:
            outcome.append(exc)

    started = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(GIVE_UP_WITHIN)
    alive = thread.is_alive()
    ident = None
    if db.kind == "postgresql":
        ident = holder.exec_driver_sql("SELECT pg_backend_pid()").scalar()
    elif db.kind == "mariadb":
        ident = holder.exec_driver_sql("SELECT CONNECTION_ID()").scalar()
    holder.rollback()
    thread.join(60)
    assert not alive, f"the store still waited for the lock after {GIVE_UP_WITHIN} s"
    assert time.monotonic() - started < GIVE_UP_WITHIN
    [error] = outcome
    assert isinstance(error, (StoreUnavailableError, QuarantineError)), repr(error)
    message = str(error)
    assert "waited 1 s for a lock" in message, message
    # One wording for every writer (dbtrigger._lock_wait.gave_up_waiting): what to do
    # and the driver's error class; the history's and the quarantine's copies lacked
    # both, and the history's error carried neither the bound nor the holders.
    assert "End the transaction left open there" in message, message
    assert re.search(r"there \(\w+\)$", message), message
    if isinstance(error, StoreUnavailableError):
        assert error.fields["seconds"] == 1, error.fields
        assert "holders" in error.fields, error.fields
    if db.kind == "postgresql":
        assert f"backend pid {ident}" in message, message
    elif db.kind == "mariadb":
        assert f"connection {ident}" in message, message
    return message


def test_a_state_write_behind_a_held_row_lock_gives_up(db: TestDatabase) -> None:
    store = SqlCheckpointStore(url=db.url, schema=db.schema, lock_timeout_seconds=1)
    holder = db.engine.connect()
    try:
        etag = store.write("orders", b'{"v": 1}', if_match=None)
        holder.begin()
        holder.exec_driver_sql(
            f"UPDATE {db.qualified('dbtrigger_state')} SET updated_at = updated_at "
            "WHERE poller_name = 'orders'"
        )
        message = gives_up(db, holder, lambda: store.write("orders", b'{"v": 2}', if_match=etag))
        assert "dbtrigger_state" in message
        found = store.read("orders")  # nothing changed; the next try wins
        assert found is not None
        assert (found.data, found.etag) == (b'{"v": 1}', etag)
        store.write("orders", b'{"v": 2}', if_match=etag)
    finally:
        holder.close()
        store.close()


def test_a_history_append_behind_an_uncommitted_one_gives_up(db: TestDatabase) -> None:
    store = SqlCheckpointStore(url=db.url, schema=db.schema, lock_timeout_seconds=1)
    history = history_for(store)
    assert history is not None
    holder = db.engine.connect()
    record = {"type": "commit", "at": "2026-01-01T00:00:00Z", "batch_id": "b1", "id": "r1"}
    try:
        history.append("orders", [record], after_seq=0)
        holder.begin()
        holder.exec_driver_sql(
            f"INSERT INTO {db.qualified('dbtrigger_state_history')} (namespace, poller_name, "
            "seq, record_id, at, type, batch_id, size, record) VALUES "
            "('default', 'orders', 2, 'x', NULL, 'commit', NULL, 2, '{}')"
        )
        gives_up(db, holder, lambda: history.append("orders", [record], after_seq=1))
        history.append("orders", [record], after_seq=1)  # once the other one is gone
        assert [r["seq"] for r in history.read("orders")] == [1, 2]
    finally:
        holder.close()
        store.close()


def test_the_default_bound_is_below_the_heartbeat(sqlite_db: TestDatabase) -> None:
    store = SqlCheckpointStore(url=sqlite_db.url)
    try:
        assert store.lock_timeout == 10  # the heartbeat renews every 40 s at the default lease
        history = history_for(store)
        assert getattr(history, "lock_timeout", None) == 10
    finally:
        store.close()


def quarantine_record() -> QuarantineRecord:
    """One dead-lettered event of poller ``orders``, as a sink's write gets it."""
    return QuarantineRecord(
        poller="orders",
        event_id="e1",
        source="test",
        pk={"id": 1},
        cursor=1,
        row=None,
        error="boom",
        attempts=5,
        checkpoint={},
        batch_id="b1",
        fencing_token=3,
        owner_id="me",
        quarantined_at=dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc),
    )


def test_a_dead_letter_write_behind_an_uncommitted_one_gives_up(db: TestDatabase) -> None:
    """Two instances setting the same event aside (a zombie and the new owner): the
    second's insert waited for the first's transaction, for ever on PostgreSQL."""
    sink = SqlQuarantineSink(url=db.url, schema=db.schema, lock_timeout_seconds=1)
    record = quarantine_record()
    holder = db.engine.connect()
    try:
        sink.put([])  # nothing: no table yet
        sink._ensure_table()
        holder.begin()
        holder.execute(quarantine_table(schema=db.schema).insert(), SqlQuarantineSink._row(record))
        gives_up(db, holder, lambda: sink.put([record]))
        sink.put([record])  # once the other one is gone
        assert [r.event_id for r in sink.records("orders")] == ["e1"]
    finally:
        holder.close()
        sink.close()
