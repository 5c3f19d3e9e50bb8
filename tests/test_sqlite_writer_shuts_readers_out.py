"""An SQLite writer holding the file's exclusive lock: the fetch says what to change.

In SQLite's default rollback-journal mode a writer whose transaction outgrew its
page cache (a bulk load) holds the exclusive lock until it commits, and every
read waits for it. The fetch gave up after its bound with words about DDL
queues (``ALTER TABLE ... VACUUM FULL, LOCK TABLE``), which SQLite does not
have; it now names the journal mode and the ``PRAGMA journal_mode=WAL`` under
which reads go on beside a writer, which the second test shows.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from dbtrigger import FetchError, InMemoryCheckpointStore, PollTrigger, SqlAlchemySource


def database(path: Path, *, wal: bool) -> None:
    with sqlite3.connect(path) as conn:
        if wal:
            conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, seq INTEGER NOT NULL)")
        conn.execute("INSERT INTO orders VALUES (1, 1)")
    conn.close()


@contextmanager
def exclusive_writer(path: Path) -> Iterator[None]:
    """A writer holding the file's exclusive lock (as one whose cache spilled does)."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("BEGIN EXCLUSIVE")
        conn.execute("INSERT INTO orders VALUES (2, 2)")
        yield
        conn.execute("ROLLBACK")
    finally:
        conn.close()


def poller(path: Path) -> PollTrigger:
    source = SqlAlchemySource(
        url=f"sqlite:///{path}",
        table="orders",
        cursor_column="seq",
        pk_columns=["id"],
        lock_timeout_seconds=0.2,
    )
    return PollTrigger(name="orders", source=source, checkpoint_store=InMemoryCheckpointStore())


def test_rollback_journal_the_error_names_wal(tmp_path: Path) -> None:
    db = tmp_path / "shop.db"
    database(db, wal=False)
    trigger = poller(db)
    try:
        with exclusive_writer(db), pytest.raises(FetchError) as caught:
            trigger.tick(lambda events: None)
        message = str(caught.value)
        assert "PRAGMA journal_mode=WAL" in message
        assert "VACUUM FULL" not in message
        assert trigger.tick(lambda events: None) == 1  # once the writer is gone
    finally:
        trigger.source.close()  # type: ignore[attr-defined]


def test_in_wal_mode_the_fetch_reads_beside_the_writer(tmp_path: Path) -> None:
    db = tmp_path / "shop.db"
    database(db, wal=True)
    trigger = poller(db)
    try:
        with exclusive_writer(db):
            assert trigger.tick(lambda events: None) == 1
    finally:
        trigger.source.close()  # type: ignore[attr-defined]
