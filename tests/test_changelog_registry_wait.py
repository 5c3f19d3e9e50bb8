"""A change log reader recording its position behind another connection's write.

On SQLite any open write transaction (the application's, a ``changelog
install``'s, a snapshot's) holds the whole file. The reader's registry write, at
its first fetch and at each checkpoint, waited behind it up to 10 s each, in the
tick and without a word: a tick of three events behind an application's open
write took 20 s and logged only that it had given up. Now it says at WARNING
what it waits for before it waits (``changelog_reader_waiting``).
"""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

import pytest
import sqlalchemy as sa

from dbtrigger import FileCheckpointStore, PollTrigger
from dbtrigger.changelog import ChangeLogSource, install
from dbtrigger.changelog.readers import registered


class LetGoWhenTold(logging.Handler):
    """Ends the holder's transaction once the reader says it waits for it: a reader
    that waited in silence would wait until its bound ran out."""

    def __init__(self, holder: sqlite3.Connection) -> None:
        super().__init__(logging.WARNING)
        self.holder = holder
        self.told: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.__dict__.get("event") == "changelog_reader_waiting":
            self.told.append(record.getMessage())
            if self.holder.in_transaction:
                self.holder.commit()


def test_the_registry_write_says_what_it_waits_for_before_it_waits(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "shop.db"
    engine = sa.create_engine(f"sqlite:///{path}")
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE orders (id INTEGER PRIMARY KEY, v INT)")
    install(engine, "orders")
    with engine.begin() as conn:
        conn.exec_driver_sql("INSERT INTO orders VALUES (1, 1), (2, 2), (3, 3)")
    source = ChangeLogSource(url=f"sqlite:///{path}", table="orders")
    trigger = PollTrigger(
        name="p", source=source, checkpoint_store=FileCheckpointStore(tmp_path / "state")
    )
    holder = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # the application's write, still open
    holder.execute("INSERT INTO orders VALUES (4, 4)")
    handler = LetGoWhenTold(holder)
    logger = logging.getLogger("dbtrigger.changelog")
    logger.addHandler(handler)
    seen: list[int] = []
    try:
        with caplog.at_level(logging.WARNING, logger="dbtrigger"):
            trigger.tick(lambda events: seen.extend(e.pk["id"] for e in events))
    finally:
        logger.removeHandler(handler)
        if holder.in_transaction:
            holder.rollback()
        holder.close()
    assert seen[:3] == [1, 2, 3], seen
    assert handler.told, [r.getMessage() for r in caplog.records]
    assert "waits for a lock another transaction holds" in handler.told[0], handler.told
    assert "write lock" in handler.told[0], handler.told  # who holds it
    gave_up = [
        r for r in caplog.records if r.__dict__.get("event") == "changelog_reader_unregistered"
    ]
    assert not gave_up, [r.getMessage() for r in gave_up]
    with engine.connect() as conn:
        readers = registered(conn, "orders", None) or []
    assert [r.name for r in readers] == ["p"]
    assert readers[0].seq >= 3, readers
    source.close()
    engine.dispose()
