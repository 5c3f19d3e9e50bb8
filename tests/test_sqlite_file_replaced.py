"""The SQLite database file replaced or deleted under a running worker.

A pooled SQLite connection holds the file it opened, not its name: after a
restore (``mv new.db shop.db``) the worker went on reading the old, unlinked
file, found nothing new on every tick and never delivered the rows of the file
the name now names; after a delete it read a ghost the same way. Now a
replaced file is followed from the checkpoint, and a deleted one fails the
fetch with a ``FetchError`` naming it (no empty file is created in its
place), until it is back.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from dbtrigger import FetchError, InMemoryCheckpointStore, PollTrigger, SqlAlchemySource


def make(path: Path, rows: list[tuple[int, str]]) -> None:
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, ts TEXT NOT NULL)")
        conn.executemany("INSERT INTO orders VALUES (?, ?)", rows)
    conn.close()


def poller(path: Path) -> PollTrigger:
    source = SqlAlchemySource(
        url=f"sqlite:///{path}", table="orders", cursor_column="ts", pk_columns=["id"]
    )
    return PollTrigger(name="orders", source=source, checkpoint_store=InMemoryCheckpointStore())


ROWS = [(1, "2026-01-01"), (2, "2026-01-02")]


def test_a_replaced_file_is_read_from_the_checkpoint(tmp_path: Path) -> None:
    db = tmp_path / "shop.db"
    make(db, ROWS)
    trigger = poller(db)
    got: list[Any] = []
    try:
        assert trigger.tick(lambda events: got.extend(e.pk["id"] for e in events)) == 2
        make(tmp_path / "restored.db", [*ROWS, (3, "2026-01-03")])
        os.replace(tmp_path / "restored.db", db)
        trigger.tick(lambda events: got.extend(e.pk["id"] for e in events))
        assert got == [1, 2, 3]
    finally:
        trigger.source.close()  # type: ignore[attr-defined]


def test_a_deleted_file_fails_the_fetch_naming_it_until_it_is_back(tmp_path: Path) -> None:
    db = tmp_path / "shop.db"
    make(db, ROWS)
    trigger = poller(db)
    got: list[Any] = []
    try:
        trigger.tick(lambda events: got.extend(e.pk["id"] for e in events))
        os.replace(db, tmp_path / "aside.db")
        with pytest.raises(FetchError, match=r"shop\.db is gone") as caught:
            trigger.tick(lambda events: got.extend(e.pk["id"] for e in events))
        assert "Put the database back" in str(caught.value)
        assert not db.exists()  # no empty database was created in its place
        with sqlite3.connect(tmp_path / "aside.db") as conn:
            conn.execute("INSERT INTO orders VALUES (3, '2026-01-03')")
        conn.close()
        os.replace(tmp_path / "aside.db", db)
        trigger.tick(lambda events: got.extend(e.pk["id"] for e in events))
        assert got == [1, 2, 3]
    finally:
        trigger.source.close()  # type: ignore[attr-defined]
