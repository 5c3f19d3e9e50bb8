"""An SQLite date/time cursor holding numbers beside text: the numbers are said, not lost.

SQLite keeps a number written to a ``DATETIME`` column as a number and sorts
every number before every text. Once the checkpoint is a text value, a row a
writer stores with a number (unix time) is behind it: the keyset never reads
it. Before, it was skipped without a word; the NULL-cursor probe now also names
such rows (``cursor_numbers_before_text`` at WARNING) when the column holds text too.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import sqlalchemy as sa

from dbtrigger import InMemoryCheckpointStore, PollTrigger, SqlAlchemySource
from tests.databases import TestDatabase


def poller(db: TestDatabase, store: InMemoryCheckpointStore | None = None) -> PollTrigger:
    source = SqlAlchemySource(
        url=db.url, table="ev", schema=db.schema, cursor_column="ts", pk_columns=["id"]
    )
    return PollTrigger(
        name="ev", source=source, checkpoint_store=store or InMemoryCheckpointStore()
    )


def said(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "event", None) == "cursor_numbers_before_text"]


def test_a_number_written_behind_a_text_checkpoint_is_named(
    sqlite_db: TestDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    with sqlite_db.engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE ev (id INTEGER PRIMARY KEY, ts DATETIME)"))
        conn.execute(sa.text("INSERT INTO ev VALUES (1, '2020-01-01 00:00:00')"))
    store = InMemoryCheckpointStore()
    trigger = poller(sqlite_db, store)
    got: list[Any] = []
    try:
        trigger.tick(lambda events: got.extend(e.pk["id"] for e in events))
        with sqlite_db.engine.begin() as conn:
            conn.execute(sa.text("INSERT INTO ev VALUES (2, 1700000000), (3, '2020-01-02')"))
        trigger.source.close()  # type: ignore[attr-defined]
        trigger = poller(sqlite_db, store)  # a new start probes at its first tick
        with caplog.at_level(logging.WARNING, logger="dbtrigger"):
            trigger.tick(lambda events: got.extend(e.pk["id"] for e in events))
        assert got == [1, 3]  # row 2 sorts before the checkpoint's text
        records = said(caplog)
        assert len(records) == 1, [r.getMessage() for r in caplog.records]
        message = records[0].getMessage()
        assert "{'id': 2}" in message
        assert "datetime(ts, 'unixepoch')" in message
    finally:
        trigger.source.close()  # type: ignore[attr-defined]


def test_a_column_of_numbers_only_is_not_reported(
    sqlite_db: TestDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    """Unix time alone is an ordered cursor like any number: nothing to say."""
    with sqlite_db.engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE ev (id INTEGER PRIMARY KEY, ts DATETIME)"))
        conn.execute(sa.text("INSERT INTO ev VALUES (1, 1700000000), (2, 1700000001)"))
    trigger = poller(sqlite_db)
    got: list[Any] = []
    try:
        with caplog.at_level(logging.WARNING, logger="dbtrigger"):
            trigger.tick(lambda events: got.extend(e.pk["id"] for e in events))
        assert got == [1, 2]
        assert said(caplog) == []
    finally:
        trigger.source.close()  # type: ignore[attr-defined]
