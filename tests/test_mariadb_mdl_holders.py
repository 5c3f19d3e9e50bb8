"""MariaDB names a metadata lock's holder, or says honestly that it cannot.

An application's transaction that only *read* a table holds the table's
metadata lock until it ends: an ``ALTER TABLE`` waits for it, and every later
reader of the table queues behind that ALTER. The words of a statement that
gave up waiting (:func:`~dbtrigger._lock_wait.gave_up_waiting`) named only
transactions holding row or table locks in ``INNODB_TRX``, so that reader,
which locks no row, was never named: a source's fetch said who held nothing.
Without the ``metadata_lock_info`` plugin (``INSTALL SONAME`` is an
administrator's choice; the shared test server has not got it) no view says
who holds a metadata lock: every open transaction is named as a possible
holder, the DDL queued ahead as waiting too, and the words say which holds
it cannot be told. With no open transaction at all they say the holder
cannot be named.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from dbtrigger._lock_wait import lock_holders
from dbtrigger.cursor import BEGINNING
from dbtrigger.errors import FetchError
from tests.databases import TestDatabase
from tests.test_ddl_locks import outcome
from tests.test_source_lock_waits import ddl_queued, insert, orders, source_on

pytestmark = [pytest.mark.mariadb, pytest.mark.xdist_group("shared-horizons")]


@contextlib.contextmanager
def reading(db: TestDatabase, table: str, ident: list[int]) -> Iterator[None]:
    """An application's transaction that read ``table`` and stays open (its
    connection id appended to ``ident``)."""
    holder = db.engine.connect()
    try:
        holder.begin()
        holder.exec_driver_sql(f"SELECT * FROM {db.qualified(table)}").fetchall()
        ident.append(int(holder.exec_driver_sql("SELECT CONNECTION_ID()").scalar_one()))
        yield
    finally:
        holder.rollback()
        holder.close()


def test_a_fetch_behind_ddl_queued_behind_a_reader_names_the_reader(
    mariadb: TestDatabase,
) -> None:
    db = mariadb
    orders(db)
    insert(db, range(1, 4))
    source = source_on(db, lock_timeout_seconds=1.0)
    ident: list[int] = []
    try:
        assert len(source.fetch(BEGINNING, 10)) == 3  # reflected, a connection pooled
        result = outcome(
            ddl_queued(db, "orders", reading(db, "orders", ident)),
            lambda: source.fetch(BEGINNING, 10),
        )
        assert isinstance(result, FetchError), repr(result)
        message = str(result)
        assert "waited 1 s for a lock on the table and gave up" in message, message
        [reader] = ident
        assert f"connection {reader} (Sleep, transaction open for" in message, message
        assert "no row locked" in message, message
        assert "cannot be told without information_schema.METADATA_LOCK_INFO" in message
        assert "waiting for the table's metadata lock too (a DDL queued ahead)" in message
        assert "SELECT" not in message, message  # no SQL of anyone's
        assert "ADD COLUMN" not in message, message
    finally:
        source.close()


def test_with_no_open_transaction_the_holder_cannot_be_named(mariadb: TestDatabase) -> None:
    """A ``LOCK TABLES ... WRITE`` holds the table's metadata lock without a transaction."""
    db = mariadb
    orders(db)
    assert db.schema is not None
    locker = db.engine.connect()
    try:
        locker.exec_driver_sql(f"LOCK TABLES {db.qualified('orders')} WRITE")
        words = lock_holders(db.engine, "orders", db.schema)
        if "probably held by" in words:  # another test's transaction is open on the server
            assert "cannot be told" in words, words
        else:
            assert words.startswith("the holder cannot be named"), words
    finally:
        locker.exec_driver_sql("UNLOCK TABLES")
        locker.close()
