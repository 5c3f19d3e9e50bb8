"""The timer fires again while the previous invocation of the same function still runs.

The host runs both in one process, on one poller: the second finds the lease
taken (by the same owner: a live lease is never taken over, not even by its
owner), delivers nothing and returns. Its log line said "lease held by
<this process's owner id>" and, on a lost compare-and-swap, "another instance
took the lease first": a person looking for a second instance found none.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import azure.functions as func
import pytest
from azure.functions.timer import TimerRequest

from dbtrigger import DbBindings, InMemoryCheckpointStore, RowChange, SqlAlchemySource
from tests.databases import TestDatabase


@pytest.fixture
def source(sqlite_db: TestDatabase) -> Iterator[SqlAlchemySource]:
    sqlite_db.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, updated_at TEXT NOT NULL)")
    sqlite_db.execute(
        "INSERT INTO orders VALUES (:id, :ts)",
        [{"id": i, "ts": f"2026-01-01 12:00:{i:02d}"} for i in range(1, 6)],
    )
    src = SqlAlchemySource(
        url=sqlite_db.url, table="orders", cursor_column="updated_at", pk_columns=["id"]
    )
    yield src
    src.close()


def test_an_overlapping_firing_says_it_is_this_functions_own_run(
    source: SqlAlchemySource, caplog: pytest.LogCaptureFixture
) -> None:
    app = func.FunctionApp()
    db = DbBindings()
    inside, release = threading.Event(), threading.Event()
    delivered: list[list[int]] = []

    @app.schedule(schedule="0 */1 * * * *", arg_name="timer", use_monitor=True)
    @db.trigger(arg_name="events", source=source, checkpoint_store=InMemoryCheckpointStore())
    def orders(timer: func.TimerRequest, events: list[RowChange]) -> None:
        delivered.append([e.pk["id"] for e in events])
        inside.set()
        assert release.wait(30)

    (function,) = app.get_functions()
    run = function.get_user_function()
    timer = TimerRequest(past_due=True, schedule_status={}, schedule={})
    first = threading.Thread(target=run, args=(timer,))
    first.start()
    try:
        assert inside.wait(30)
        with caplog.at_level(logging.INFO, logger="dbtrigger"):
            assert run(timer) is None  # quiet: no error storm
    finally:
        release.set()
        first.join(30)
    assert delivered == [[1, 2, 3, 4, 5]]  # once: the second firing delivered nothing
    (line,) = [r.getMessage() for r in caplog.records if "lease" in r.getMessage()]
    assert "this trigger's own tick, still running in this process" in line
    assert "another instance" not in line
