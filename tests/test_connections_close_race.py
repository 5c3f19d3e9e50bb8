"""``SqlAlchemySource.close()`` landing while another thread gives a connection back.

A statement on another thread (a read-ahead's fetch, a lookup) checks the
source's generation to decide whether its connection goes back to the pool or
has its session closed (the source was closed since: its disposed pool would
keep the session open, checked in where nobody checks it out). If ``close()``
and the pool's disposal land between that check and the return, the session
stays open on the server. The check and the return are one step under
``SourceConnections._lock``; these tests hold the return at the point between
them until ``close()`` has either finished (the race lost: the connection then
goes back to the disposed pool) or is waiting for that lock, and count the
sessions this process opened that are still open on the server.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import TracebackType

import pytest
import sqlalchemy as sa

from dbtrigger import SqlAlchemySource
from dbtrigger.cursor import Position
from tests.databases import TestDatabase
from tests.reliability_support import add_items, items_table
from tests.test_readahead_real import (
    _record_sessions,  # noqa: F401 - the autouse fixture that records this process's sessions
    connections_to,
    plain_items_source,
    wait_for,
)


class WatchedLock:
    """A lock that says when a thread had to wait for it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.contended = threading.Event()

    def __enter__(self) -> WatchedLock:
        if not self._lock.acquire(blocking=False):
            self.contended.set()
            self._lock.acquire()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._lock.release()


STATEMENTS: dict[str, Callable[[SqlAlchemySource], object]] = {
    # A short read: on PostgreSQL (kept connections) through give_back, on
    # MariaDB through open(); a lookup through open() on both.
    "fetch": lambda source: source.fetch(Position(), 1000),
    "lookup": lambda source: source.count_after(Position()),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("statement", sorted(STATEMENTS))
def test_close_between_the_generation_check_and_the_return_leaves_no_session(
    server_db: TestDatabase, statement: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = items_table(server_db)
    add_items(server_db, table, range(1, 6))
    before = connections_to(server_db)
    source = plain_items_source(server_db)
    assert len(source.fetch(Position(), 1000)) == 5  # engine made, shape resolved
    lock = WatchedLock()
    source._connections._lock = lock  # type: ignore[assignment]
    old_pool = source.engine.pool  # kept referenced: a leaked session is not closed by GC
    returning, closed = threading.Event(), threading.Event()
    reader: list[threading.Thread] = []
    original_close = sa.engine.Connection.close

    def close(conn: sa.engine.Connection) -> None:
        if reader and threading.current_thread() is reader[0] and not returning.is_set():
            returning.set()
            # close() either finishes now (the connection then goes back to the
            # disposed pool) or waits for the lock held over this return.
            assert wait_for(lambda: closed.is_set() or lock.contended.is_set(), 10)
        original_close(conn)

    monkeypatch.setattr(sa.engine.Connection, "close", close)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            STATEMENTS[statement](source)
        except BaseException as exc:
            errors.append(exc)

    reader.append(threading.Thread(target=run))
    reader[0].start()
    assert returning.wait(10)
    source.close()
    closed.set()
    reader[0].join(10)
    assert not reader[0].is_alive()
    assert errors == []
    try:
        assert wait_for(lambda: connections_to(server_db) <= before, 5), (
            connections_to(server_db),
            before,
            old_pool.status(),
        )
    finally:
        old_pool.dispose()
        del old_pool


def test_the_session_count_sees_a_connection_left_in_a_disposed_pool(
    server_db: TestDatabase,
) -> None:
    """The count the test above relies on: a connection checked in to a pool
    after its disposal is a session still open."""
    table = items_table(server_db)
    add_items(server_db, table, range(1, 3))
    before = connections_to(server_db)
    source = plain_items_source(server_db)
    engine = source.engine
    pool = engine.pool
    conn = engine.connect()
    engine.dispose()
    conn.close()  # back into the disposed pool
    try:
        assert connections_to(server_db) == before + 1
    finally:
        pool.dispose()
        source.close()
    assert wait_for(lambda: connections_to(server_db) <= before, 5)
